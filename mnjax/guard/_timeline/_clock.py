"""Clock offsets between ranks by ping-pong with rank 0 (NTP's estimate): rank ``r`` sends at
``t1``, rank 0 answers at ``t0``, ``r`` receives at ``t2``; ``offset = t0 - (t1 + t2) / 2``,
from the shortest round trip, half of which bounds the error."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

__all__ = ["estimate_offsets"]

_TAG = 7302


def estimate_offsets(mpi_comm: MPI.Intracomm, now: Callable[[], int], *, rounds: int = 16,
                     max_rounds: int = 200, good_ns: int = 20_000) -> tuple[np.ndarray, np.ndarray]:
  """``(offsets, errors)`` in ns, on every rank: ``offsets[r]`` added to rank ``r``'s
  clock reading gives rank 0's, within ``errors[r]``.
  Collective over `mpi_comm` (with no other traffic); `now` reads this rank's clock. Each rank
  takes `rounds` round trips, up to `max_rounds` while the error is over `good_ns`.

  Example:
    >>> import time
    >>> offsets, errors = estimate_offsets(comm.mpi_comm, time.monotonic_ns)
    >>> bool(abs(offsets).max() <= errors.max() + 1_000_000)   # one machine: about 0
    True
  """
  rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
  mine = np.zeros(2, np.int64)  # (offset, error) of this rank
  stamp = np.zeros(1, np.int64)
  done = np.int64(-1)  # rank r's last message: no more rounds
  for peer in range(1, size):
    if rank == 0:
      while True:
        mpi_comm.Recv(stamp, source=peer, tag=_TAG)
        if stamp[0] == done:
          break
        stamp[0] = now()
        mpi_comm.Send(stamp, dest=peer, tag=_TAG)
    elif rank == peer:
      best = None
      for i in range(max_rounds):
        if i >= rounds and best[0] <= 2 * good_ns:
          break
        t1 = now()
        stamp[0] = t1
        mpi_comm.Send(stamp, dest=0, tag=_TAG)
        mpi_comm.Recv(stamp, source=0, tag=_TAG)
        t2 = now()
        if best is None or t2 - t1 < best[0]:
          best = (t2 - t1, int(stamp[0]) - (t1 + t2) // 2)
      stamp[0] = done
      mpi_comm.Send(stamp, dest=0, tag=_TAG)
      mine[:] = best[1], (best[0] + 1) // 2
  everyone = np.zeros((size, 2), np.int64)
  mpi_comm.Allgather(mine, everyone)
  return everyone[:, 0].copy(), everyone[:, 1].copy()
