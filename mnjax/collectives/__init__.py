"""ChainerMN's communicator methods, host side: point-to-point, collectives, `split`.

Outside any trace (between steps, at start-up), on ``comm.mpi_comm``; each is also a method
of `Communicator` (``comm.send(x, dest, tag)`` is ``mnjax.collectives.send(x, comm, dest,
tag)``):

* `split`: the `Communicator` of a group of ranks (data x model parallelism);
* arrays: `send` / `recv` (pytrees), `bcast`, `gather`, `allgather`, `alltoall`, `scatter`;
* picklable objects: `send_obj` / `recv_obj`, `bcast_obj`, `gather_obj`, `allreduce_obj`.

The collectives compare what every rank passed first (operation, root, shapes, dtypes,
sizes) and raise the same error on every rank on a mismatch; payloads of any size move in
pieces MPI can count. In-step (differentiable) communication is `mnjax.functions`'.

Example::

    data_comm = comm.split(color=comm.rank % 2, key=comm.rank)
    config = comm.bcast_obj(config if comm.is_root else None, root=0)
"""

from mnjax.collectives._arrays import allgather, alltoall, bcast, gather, recv, scatter, send
from mnjax.collectives._objects import allreduce_obj, bcast_obj, gather_obj, recv_obj, send_obj
from mnjax.collectives._split import split

__all__ = [
    "allgather",
    "allreduce_obj",
    "alltoall",
    "bcast",
    "bcast_obj",
    "gather",
    "gather_obj",
    "recv",
    "recv_obj",
    "scatter",
    "send",
    "send_obj",
    "split",
]
