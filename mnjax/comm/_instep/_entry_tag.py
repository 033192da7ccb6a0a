"""The tag ending an exchange's sequence entry: `entry` writes it, the pairing check reads `TAG`."""

from __future__ import annotations

import re

from mpi4py import MPI

__all__ = ["TAG", "entry", "world_ranks"]

#: What `entry` appends, as the pairing check parses it.
TAG = re.compile(
    r" <mnjax\.functions (?P<kind>send|recv|collective|refused)"
    r"(?: peer=(?P<peer>\d+))?(?: phase=(?P<phase>\w+))?(?: comm=(?P<comm>\d+))?"
    r" group=(?P<group>[\d,]*)>$")


def entry(label: str, kind: str, group: tuple[int, ...], *, peer: int | None = None,
          phase: str | None = None, comm: int | None = None) -> str:
  """The ``what`` of an exchange's entry (`comm`: the communicator's `uid`, so others never pair).

  Example:
    >>> entry("mnjax.functions.send", "send", (0, 1), peer=1, phase="forward")
    'mnjax.functions.send <mnjax.functions send peer=1 phase=forward group=0,1>'
  """
  fields = "".join([f" peer={peer}" if peer is not None else "",
                    f" phase={phase}" if phase is not None else "",
                    f" comm={comm}" if comm is not None else ""])
  return f"{label} <mnjax.functions {kind}{fields} group={','.join(map(str, group))}>"


_WORLD_RANKS: dict[int, tuple[int, ...]] = {}  # by communicator handle


def _translate(comm: MPI.Comm) -> tuple[int, ...]:
  group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
  try:
    return tuple(int(r) for r in MPI.Group.Translate_ranks(group, list(range(comm.Get_size())),
                                                            world))
  finally:
    group.Free()
    world.Free()


def world_ranks(mpi_comm: MPI.Comm) -> tuple[int, ...]:
  """``MPI.COMM_WORLD`` rank of each rank of `mpi_comm` (local: no communication).

  Example:
    >>> world_ranks(MPI.COMM_WORLD) == tuple(range(MPI.COMM_WORLD.Get_size()))
    True
  """
  handle = int(MPI._handleof(mpi_comm))
  if handle not in _WORLD_RANKS:
    _WORLD_RANKS[handle] = _translate(mpi_comm)
  return _WORLD_RANKS[handle]
