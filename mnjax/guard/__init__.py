"""Guards: turn a would-be hang or a silent wrong result into a clear error on every rank.

* `check_same_on_all_ranks`: the pre-flight check that a collective's operands agree.
* `check_replicas` / `fingerprints`: are the replicas still bitwise identical?
* `Watchdog`: a background thread that names a stalled rank and aborts the job.
* `Timeline`: every rank's collectives as one Chrome/Perfetto trace, and a straggler report.
* `rank_dependent`: a scope whose constants may differ per rank in the program check.

Example::

    mnjax.guard.check_replicas(state.params, comm)
"""

from mnjax.guard._consensus import check_replicas, fingerprints
from mnjax.guard._preflight import DEFAULT_TIMEOUT, check_same_on_all_ranks, tree_signature
from mnjax.guard._program import rank_dependent
from mnjax.guard._timeline import Timeline
from mnjax.guard._watchdog import Watchdog

__all__ = [
    "DEFAULT_TIMEOUT",
    "Timeline",
    "Watchdog",
    "check_replicas",
    "check_same_on_all_ranks",
    "fingerprints",
    "rank_dependent",
    "tree_signature",
]
