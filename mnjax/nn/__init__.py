"""Flax layers that need the communicator.

* `SyncBatchNorm`: a drop-in for `flax.linen.BatchNorm` whose statistics are those of the
  global batch, over every device of every rank.
* `create_mnbn_model`: an existing model whose flax ``nn.BatchNorm`` layers run as
  `SyncBatchNorm`, without editing it (the same variable tree: checkpoints load).
* `allreduce_persistent`: averages batch statistics (or any float persistent values; integer
  counters pass through, checked equal) over ranks
  (a host collective of `mnjax.comm`, exported here too).

Example::

    norm = partial(mnjax.nn.SyncBatchNorm, comm=comm, use_running_average=not train)
"""

from mnjax.comm._host._broadcast import allreduce_persistent
from mnjax.nn._batch_norm import SyncBatchNorm
from mnjax.nn._convert import create_mnbn_model

__all__ = ["SyncBatchNorm", "allreduce_persistent", "create_mnbn_model"]
