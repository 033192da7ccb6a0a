"""The departure-aware wait of every host round: a peer that finished is named, not waited for."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mnjax.comm import _departures as departures

__all__ = ["DEPARTURE_GRACE", "wait"]

#: Seconds to keep waiting once a peer finished (it may have done its part just before).
DEPARTURE_GRACE = 2.0


def wait(comm: Any, request: Any, what: str, *, peers: Sequence[int] | None = None,
         timeout: float | None = None, timeout_message: str = "") -> None:
  """Completes `request` (anything with ``Test()``); raises `RuntimeError` naming a rank of
  `peers` (default: any) that finished its program, and past `timeout`, `TimeoutError`.

  Example:
    >>> wait(comm, comm.mpi_comm.Ibarrier(), "a barrier")
  """

  def departed() -> list[int]:
    return [r for r in departures.departed(comm.mpi_comm) if peers is None or r in peers]

  start = time.monotonic()
  gone_since = None
  while not request.Test():
    now = time.monotonic()
    if timeout is not None and now - start > timeout:
      raise TimeoutError(timeout_message)
    if gone_since is None and now - start > 0.05 and departed():
      gone_since = now
    if gone_since is not None and now - gone_since > DEPARTURE_GRACE:
      gone = departed()
      raise RuntimeError(
          f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} finished"
          f" {'their programs' if len(gone) > 1 else 'its program'} (exited normally) while"
          f" the other ranks wait for every rank in {what}: the job cannot go on. The ranks"
          " must run the same program (the same steps, the same calls of mnjax's"
          " collectives and checks); look for a loop, a condition or a model that differs"
          " between ranks.")
    time.sleep(1e-3 if now - start < 1.0 else 1e-2)
