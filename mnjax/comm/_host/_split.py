"""``comm.split``'s host side: colors and keys checked on every rank, the MPI communicator
split (``Comm_split``), and the group's node topology from the parent's nodes."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.comm._host._agreement import everyone
from mnjax.comm._topology import node_topology

__all__ = ["split_group"]


def _describe(value: Any, *, none: str) -> tuple:
  if value is None:
    return (none,)
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return ("int", int(value))
  return ("bad", type(value).__name__, repr(value)[:40])


def split_group(comm: Any, color: int | None, key: int | None = None) -> tuple | None:
  """``(group's MPI communicator, node topology)`` for the ranks passing the same `color`, or
  None; bad colors or keys, or kind ``xla``: the same `ValueError` on every rank.

  Example:
    >>> sub, topology = split_group(comm, color=0)
    >>> sub.Get_size() == comm.size and len(topology) == 4
    True
  """
  if comm.kind == "xla":  # the same kind on every rank: every rank raises here
    raise ValueError(
        "split: kind 'xla' runs its collectives over jax.distributed's one global mesh of"
        " every process, which a group of processes cannot have of its own. Split a"
        " communicator of an MPI kind ('flat', 'hierarchical', 'two_dimensional',"
        " 'single_node'), or express the groups as axes of one mesh (comm.mesh).")
  described = everyone(comm, "split",
                       (_describe(color, none="none"), _describe(key, none="default")),
                       "split's check of every rank's color and key")
  _check(described)
  sub = comm.mpi_comm.Split(MPI.UNDEFINED if color is None else int(color),
                            comm.rank if key is None else int(key))
  if sub == MPI.COMM_NULL:
    return None
  node = sub.Split(color=comm.inter_rank, key=sub.rank)  # the parent's nodes, among members
  topology = node_topology(sub, node)
  node.Free()
  return sub, topology


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
