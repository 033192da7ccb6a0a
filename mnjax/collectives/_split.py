"""`split`: a `Communicator` for a group of ranks (MPI's ``Comm_split``, ChainerMN's
``comm.split``), for data x model parallelism.

ChainerMN's "dual parallel" training splits the job twice: the ranks holding the same stage
of a model-parallel network form a data-parallel group that averages its gradients, and
the ranks holding one replica of the whole model form a model-parallel group that passes
activations. Each group is an ordinary `Communicator`: `mnjax.allreduce_gradients`,
`mnjax.SyncBatchNorm`, `mnjax.Checkpointer`, the guards and the host collectives take it
like any other, and its in-step collectives run on its own MPI clones (so they never mix
with the parent's or another group's).

The group keeps the parent's kind, devices and axis name; its node topology
(``intra_rank`` ... ``inter_size``) is recomputed among its members from the parent's nodes
(real ones, or ``MNJAX_EMULATE_NODES``'s). The arguments are compared across ranks first:
a color that is not an int on some rank, or keys of different kinds, is the same
`ValueError` on every rank, naming them, before ``Comm_split`` runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.collectives._agreement import everyone
from mnjax.comm import _process_view as process_view
from mnjax.comm._communicator import Communicator, assemble, check_communicator
from mnjax.comm._topology import node_topology

__all__ = ["split"]


def _describe(value: Any, *, none: str) -> tuple:
  if value is None:
    return (none,)
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return ("int", int(value))
  return ("bad", type(value).__name__, repr(value)[:40])


def split(comm: Communicator, color: int | None, key: int | None = None) -> Communicator | None:
  """The communicator of the ranks that pass the same `color` (collective: every rank of
  `comm` calls it, with its own color).

  Args:
    comm: the parent `Communicator`.
    color: a non-negative int: ranks with equal colors form one group. ``None`` (MPI's
      ``MPI_UNDEFINED``): this rank joins no group and gets ``None``.
    key: orders the ranks within a group (ties by parent rank); default: the parent rank.
      Either every rank passes an int or every rank passes None.

  Returns:
    A `Communicator` of the parent's kind, devices and axis name, with ``rank``/``size``
    within the group and the group's node topology; ``None`` where `color` is None.

  Raises:
    ValueError: on every rank, before any group is made, where some rank's color is not
      a non-negative int or None, or the keys are of different kinds or not ints; where the
      kind is ``xla`` (its collectives run over jax.distributed's one global mesh).

  Example:
    >>> data_comm = mnjax.collectives.split(comm, color=comm.rank % 2, key=comm.rank)
    >>> data_comm.size == len(range(comm.rank % 2, comm.size, 2))
    True
    >>> same = comm.split(color=0, key=-comm.rank)      # the method: ranks in reverse order
    >>> same.rank == comm.size - 1 - comm.rank
    True
  """
  check_communicator(comm, "split")
  if comm.kind == "xla":  # the same kind on every rank: every rank raises here
    raise ValueError(
        "split: kind 'xla' runs its collectives over jax.distributed's one global mesh of"
        " every process, which a group of processes cannot have of its own. Split a"
        " communicator of an MPI kind ('flat', 'hierarchical', 'two_dimensional',"
        " 'single_node'), or express the groups as axes of one mesh (comm.mesh).")
  described = everyone(comm, (_describe(color, none="none"), _describe(key, none="default")),
                       "split's check of every rank's color and key")
  _check(described)
  sub = comm.mpi_comm.Split(MPI.UNDEFINED if color is None else int(color),
                            comm.rank if key is None else int(key))
  if sub == MPI.COMM_NULL:
    return None
  node = sub.Split(color=comm.inter_rank, key=sub.rank)  # the parent's nodes, among members
  topology = node_topology(sub, node)
  node.Free()
  group = assemble(comm.kind, sub, topology, comm.devices, comm.axis_name)
  process_view.watch_group(group)
  return group


def _check(described: list[tuple]) -> None:
  """The same `ValueError` on every rank unless the colors and keys are valid together."""
  colors = [c for c, _ in described]
  bad = [r for r, c in enumerate(colors) if c[0] == "bad" or (c[0] == "int" and c[1] < 0)]
  if bad:
    shown = ", ".join(f"rank {r} color={_shown(colors[r])}" for r in bad[:4])
    raise ValueError(
        f"split: every rank's color must be a non-negative int (ranks with equal colors"
        f" form a group) or None (no group), but {shown}."
        " Compute the color as an int on every rank, e.g. color=comm.rank % 2;"
        " no group was made.")
  keys = [k for _, k in described]
  bad = [r for r, k in enumerate(keys) if k[0] == "bad"]
  kinds = {k[0] for k in keys}
  if bad or len(kinds) > 1:
    wrong = bad or [r for r, k in enumerate(keys) if k[0] != keys[0][0]]
    shown = ", ".join(f"rank {r} key={_shown(keys[r])}" for r in wrong[:4])
    raise ValueError(
        "split: the key must be an int on every rank (it orders the ranks of a group) or"
        f" None on every rank (the parent's order), but {shown}"
        f"{' while rank 0 passed ' + _shown(keys[0]) if not bad else ''}. Pass the same kind"
        " of key everywhere, e.g. key=comm.rank; no group was made.")


def _shown(described: tuple) -> str:
  if described[0] == "int":
    return str(described[1])
  if described[0] == "bad":
    return f"{described[2]} ({described[1]})"
  return "None"
