"""Layer 1 — communication: who am I, and how pytrees move between ranks.

* `create_communicator` / `Communicator`: MPI rank and size, node-local ranks, the JAX
  devices this rank drives, and a private clone of the MPI communicator (`KINDS` lists the
  layouts).
* In-step collectives, callable inside `jax.jit`: `allreduce_tree` fuses a pytree into
  buckets and allreduces them in one order on every rank, optionally over a 16-bit wire
  (`WIRE_DTYPES`, `error_bound`).
* Host collectives, outside any trace: `broadcast` (and, under `mnjax.nn`'s
  `allreduce_persistent` and `mnjax.train`'s metrics, exact sums), each checking first that
  every rank passed the same tree.
* `abort`, `install_abort_on_error`: one failing rank ends the job instead of leaving its
  peers waiting.
* ChainerMN's methods on `Communicator` (``comm.split``, ``comm.send``, ``comm.bcast_obj``,
  ...) delegate to `mnjax.collectives`, imported when one is called.

Example::

    comm = mnjax.comm.create_communicator("flat")
    params = mnjax.comm.broadcast(params, comm, root=0)
"""

from mnjax.comm._buckets import DEFAULT_BUCKET_BYTES, bucket_bytes_from_mb, default_bucket_bytes
from mnjax.comm._collectives import allreduce_tree
from mnjax.comm._communicator import KINDS, Communicator, check_communicator, create_communicator
from mnjax.comm._failfast import abort
from mnjax.comm._failfast import install as install_abort_on_error
from mnjax.comm._host import broadcast
from mnjax.comm._wire import WIRE_DTYPES, error_bound

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "KINDS",
    "WIRE_DTYPES",
    "Communicator",
    "abort",
    "allreduce_tree",
    "broadcast",
    "bucket_bytes_from_mb",
    "check_communicator",
    "create_communicator",
    "default_bucket_bytes",
    "error_bound",
    "install_abort_on_error",
]
