"""Ranks that finished: at a normal exit a rank sends each peer one small notice, so ranks
waiting in mnjax's host collectives raise naming it instead of hanging (docs/design/failures.md)."""

from __future__ import annotations

import atexit
import threading
import time

import numpy as np
from mpi4py import MPI

__all__ = ["TAG", "WAIT_TAG", "announce", "departed"]

#: The tag of the exit notices on MPI_COMM_WORLD (the native handlers probe for it too).
TAG = 7302
#: The tag of the wait notices (the native handlers' ``wait_notices.h``): a wait that lasts
#: tells the ranks it waits for, so that a step's exchange and a host round that wait for each
#: other end the job at once.
WAIT_TAG = 7303
_lock = threading.Lock()
_gone: set[int] = set()  # ranks of MPI_COMM_WORLD known to have finished
_registered = False


def announce() -> None:
  """Registers this rank's exit notice (idempotent; nothing on a single process).

  Example:
    >>> mnjax.comm._departures.announce()   # create_communicator does it already
  """
  global _registered
  if MPI.COMM_WORLD.Get_size() == 1 or _registered:
    return
  _registered = True
  atexit.register(_notify)  # after mpi4py's own handler: runs first, before MPI_Finalize


def _notify() -> None:
  if MPI.Is_finalized():
    return
  try:
    _send_and_collect()
  except MPI.Exception:  # a peer already gone (another network): nobody left to tell
    pass


def _send_and_collect() -> None:
  world = MPI.COMM_WORLD
  me = np.array([world.Get_rank()], np.int64)
  requests = [world.Isend(me, dest=peer, tag=TAG)
              for peer in range(world.Get_size()) if peer != world.Get_rank()]
  MPI.Request.Waitall(requests)  # 8 bytes each: complete locally (eager), received or not
  # Take in the peers' notices before MPI_Finalize: left unreceived, xla jobs die at exit.
  deadline = time.monotonic() + EXIT_WAIT
  while len(_receive()) < world.Get_size() - 1 and time.monotonic() < deadline:
    time.sleep(1e-3)
  notice = np.empty(128, np.uint8)  # and the wait notices (wait_notices.h), same reason
  while (message := world.Improbe(source=MPI.ANY_SOURCE, tag=WAIT_TAG)) is not None:
    message.Recv(notice)


#: Seconds a rank that exits waits for the notices of the others (normally milliseconds).
EXIT_WAIT = 1.0


def _receive() -> set[int]:
  """Takes in every notice that has arrived; returns the world ranks known to be gone."""
  world = MPI.COMM_WORLD
  with _lock:
    status = MPI.Status()
    while world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
      message = np.empty(1, np.int64)
      world.Recv(message, source=status.Get_source(), tag=TAG)
      _gone.add(int(message[0]))
    return set(_gone)


def departed(mpi_comm: MPI.Comm) -> list[int]:
  """The ranks of `mpi_comm` known to have finished their program (local; non-blocking).

  Example:
    >>> mnjax.comm._departures.departed(comm.mpi_comm)
    []
  """
  gone = sorted(_receive())
  if not gone:
    return []
  world = MPI.COMM_WORLD
  ranks = MPI.Group.Translate_ranks(world.Get_group(), gone, mpi_comm.Get_group())
  return sorted(r for r in ranks if r != MPI.UNDEFINED)
