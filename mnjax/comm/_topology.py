"""Which ranks share a node (MPI's shared-memory split, or ``MNJAX_EMULATE_NODES``), and where
each node sits among the nodes."""

from __future__ import annotations

import os

from mpi4py import MPI

__all__ = ["EMULATE_NODES", "node_split", "node_topology"]

#: Environment variable: emulate this many nodes of consecutive ranks (a testing aid).
EMULATE_NODES = "MNJAX_EMULATE_NODES"


def node_split(clone: MPI.Intracomm) -> MPI.Intracomm:
  """The processes on this node (shared-memory split, or ``MNJAX_EMULATE_NODES``); collective.

  Example:
    >>> node = node_split(comm.mpi_comm)        # one process: its own node
    >>> node.size
    1
    >>> node.Free()
  """
  emulate = os.environ.get(EMULATE_NODES, "")
  if not emulate:
    return clone.Split_type(MPI.COMM_TYPE_SHARED, key=clone.rank)
  k = int(emulate) if emulate.isdigit() else 0
  if k < 1 or clone.size % k:
    raise ValueError(
        f"create_communicator: {EMULATE_NODES}={emulate!r} must be a positive number of"
        f" emulated nodes that divides the {clone.size} processes; unset it to use the real"
        " nodes."
    )
  return clone.Split(color=clone.rank // (clone.size // k), key=clone.rank)


def node_topology(clone: MPI.Intracomm, node: MPI.Intracomm) -> tuple[int, int, int, int]:
  """``(intra_rank, intra_size, inter_rank, inter_size)`` from `node`, `clone` split by node.

  Example:
    >>> node = comm.mpi_comm.Split(color=0, key=comm.rank)    # one node
    >>> node_topology(comm.mpi_comm, node) == (comm.rank, comm.size, 0, 1)
    True
    >>> node.Free()
  """
  # Node index: count the node leaders (node-local rank 0) that come before ours.
  leader = int(node.rank == 0)
  inter_size = clone.allreduce(leader)
  before = clone.exscan(leader)
  inter_rank = node.bcast(before or 0, root=0)
  return node.rank, node.size, inter_rank, inter_size
