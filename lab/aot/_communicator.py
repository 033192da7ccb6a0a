"""A `Communicator` for a job that is not running: one process compiles every rank's step.

`mnjax.create_communicator` needs the job's processes (MPI, and for ``xla``
``jax.distributed``). Compiling ahead of time there are none, and no GPU. `communicator`
builds the same frozen record that `create_communicator` would hand rank `rank` of a job on
a `lab.aot.Target`, so that the real transformations (`allreduce_gradients`,
`shard_optimizer`, `SyncBatchNorm`) trace the real step. What a real rank would exchange on
the host while tracing (the pre-flight comparison of gradient trees and of the step's
collectives, `mnjax.guard._preflight`) is answered by `PlaysEveryRank`: every other rank
would trace this same program (SPMD), so every rank's value is this process's. The
comparison itself is what cannot run here: it needs the ranks.

Kinds and processes, as the experiments launch them on GPUs:

* ``xla``: one process per GPU; the step is one SPMD program over the mesh of every GPU of
  the job (`lab.aot.mesh`), compiled once for all processes.
* ``flat``: one process per GPU, each compiling its own one-device program with MPI custom
  calls (mpi4jax's CUDA handlers); `rank` matters where the program depends on it
  (`shard_optimizer` owns share ``rank`` of every leaf).
* ``hierarchical``, ``two_dimensional``: one process per node driving its GPUs.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mnjax.comm._communicator import MULTI_DEVICE_KINDS, Communicator

__all__ = ["KIND_PROCESSES", "PlaysEveryRank", "communicator"]

#: GPUs per process for each kind the experiments run on GPUs.
KIND_PROCESSES = {"xla": "gpu", "flat": "gpu", "hierarchical": "node", "two_dimensional": "node"}


class _Done:
  """A completed request (mpi4py's ``Request.Test``/``Wait``)."""

  def Test(self) -> bool:
    return True

  def Wait(self) -> None:
    return None


class PlaysEveryRank(MPI.Intracomm):
  """This process's ``COMM_SELF`` clone, standing for the `size` ranks of an absent job.

  ``Get_size`` is the job's; every gather hands back this process's value from each rank.
  The MPI handle is a real one (it is an attribute of the compiled MPI custom calls).

  Example:
    >>> everyone = PlaysEveryRank.of(4, rank=1)
    >>> everyone.Get_size(), everyone.Get_rank(), everyone.allgather("tree")
    (4, 1, ['tree', 'tree', 'tree', 'tree'])
  """

  _size: int
  _rank: int

  @classmethod
  def of(cls, size: int, rank: int = 0) -> PlaysEveryRank:
    comm = cls(MPI.COMM_SELF.Clone())
    comm._size, comm._rank = int(size), int(rank)
    return comm

  def Get_size(self) -> int:
    return self._size

  def Get_rank(self) -> int:
    return self._rank

  def allgather(self, value):
    return [value] * self._size

  def Iallgather(self, send, recv):
    recv[...] = np.asarray(send)[None]
    return _Done()

  def bcast(self, value, root: int = 0):
    del root
    return value

  def Clone(self) -> PlaysEveryRank:
    return PlaysEveryRank.of(self._size, self._rank)


def communicator(kind: str, target, devices, *, rank: int = 0, axis_name: str = "batch"
                 ) -> Communicator:
  """Rank `rank`'s `Communicator` of kind `kind` in a job on `target` (a `lab.aot.Target`)
  whose devices, process-major, are `devices` (a topology's): it drives its share of them.

  Example:
    >>> from lab.aot import parse_target
    >>> comm = communicator("flat", parse_target("2x4xH200"), range(8), rank=5)
    >>> comm.size, comm.inter_rank, comm.intra_rank, comm.num_replicas
    (8, 1, 1, 8)
    >>> comm.devices
    (5,)
  """
  if kind not in KIND_PROCESSES:
    raise ValueError(f"lab.aot: kind {kind!r} cannot be compiled for GPUs here; kinds:"
                     f" {', '.join(KIND_PROCESSES)}.")
  per_node = target.gpus_per_node if KIND_PROCESSES[kind] == "gpu" else 1
  size = target.nodes * per_node
  local = 1 if KIND_PROCESSES[kind] == "gpu" else target.gpus_per_node
  if not 0 <= rank < size:
    raise ValueError(f"lab.aot: rank {rank} is not one of the {size} processes of {target}.")
  mpi_comm = PlaysEveryRank.of(size, rank)
  multi = kind in MULTI_DEVICE_KINDS
  return Communicator(
      kind=kind, rank=rank, size=size, intra_rank=rank % per_node, intra_size=per_node,
      inter_rank=rank // per_node, inter_size=target.nodes, local_device_count=local,
      axis_name=axis_name, handle=int(mpi_comm.py2f()), mpi_comm=mpi_comm,
      device_comm=mpi_comm.Clone(),
      device_comms=tuple(mpi_comm.Clone() for _ in range(local)) if multi else (),
      devices=tuple(devices)[rank * local:(rank + 1) * local])
