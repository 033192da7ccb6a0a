"""Communication: who am I, and how pytrees move between ranks.

* `create_communicator` / `Communicator` (rank, node, devices, a private MPI clone; `KINDS`),
  with ChainerMN's host methods (``comm.split``, ``send``, ``bcast``, ..., ``*_obj``) and
  `abort` / `install_abort_on_error`.
* In-step, inside `jax.jit`: `allreduce_tree`, bucketed, optionally over a 16-bit wire
  (`WIRE_DTYPES`, `error_bound`).
* Host path, outside any trace: `broadcast` and exact host sums.

Example::

    comm = mnjax.comm.create_communicator("flat")
    params = mnjax.comm.broadcast(params, comm, root=0)
"""

from mnjax.comm._communicator import KINDS, Communicator, check_communicator
from mnjax.comm._create import create_communicator
from mnjax.comm._failfast import abort
from mnjax.comm._failfast import install as install_abort_on_error
from mnjax.comm._host._broadcast import broadcast
from mnjax.comm._instep._allreduce import allreduce_tree
from mnjax.comm._instep._buckets import (
    DEFAULT_BUCKET_BYTES,
    bucket_bytes_from_mb,
    default_bucket_bytes,
)
from mnjax.comm._instep._wire import WIRE_DTYPES, error_bound

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
