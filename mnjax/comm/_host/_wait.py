"""The departure-aware wait of every host round: a peer that finished is named, not waited for,
and one that waits for this rank in a step's exchange, or in a host round of another
communicator, is named within seconds (the two can never meet)."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from mnjax.comm import _departures as departures
from mnjax.comm._instep import _native as native
from mnjax.comm._instep._entry_tag import world_ranks

__all__ = ["DEPARTURE_GRACE", "wait"]

#: Seconds to keep waiting once a peer finished (it may have done its part just before).
DEPARTURE_GRACE = 2.0


def wait(comm: Any, request: Any, what: str, *, peers: Sequence[int] | None = None,
         message: tuple[int, int, int] | None = None, timeout: float | None = None,
         timeout_message: str = "") -> None:
  """Completes `request` (anything with ``Test()``); raises `RuntimeError` naming a rank of
  `peers` (default: any) that finished its program or that waits for this rank where this
  wait can never meet it (`native.HostWait`): in a step's exchange, in a host round of
  another communicator, in a collective while this rank sends it a message, or for a message
  of another tag. Past `timeout` (default ``MNJAX_WAIT_TIMEOUT``, 300 s), `TimeoutError`:
  `timeout_message` (or one naming `what`), then the ranks it needs that wait in it too and
  those that do not (alive, but somewhere else: their own code, or stuck).

  `message` is ``(source, dest, tag)`` for a point-to-point message's wait (ranks of `comm`;
  a negative tag: any tag), None for a round of every rank of `comm`.

  Example:
    >>> wait(comm, comm.mpi_comm.Ibarrier(), "a barrier")
  """

  def departed() -> list[int]:
    return [r for r in departures.departed(comm.mpi_comm) if peers is None or r in peers]

  limit = native.wait_timeout() if timeout is None else timeout
  start = time.monotonic()
  gone_since = None
  notice = native.HostWait(lambda: _world_peers(comm, peers), what,
                           scope=_scope(getattr(comm, "uid", 0), message))
  try:
    while not request.Test():
      now = time.monotonic()
      if now - start > limit:
        raise TimeoutError(_timed_out(comm, what, limit, timeout_message, notice, peers))
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
      if (stuck := notice.check(now - start)) is not None:
        _never_meet(what, *stuck)
      time.sleep(1e-3 if now - start < 1.0 else 1e-2)
  finally:
    notice.end()


def _timed_out(comm: Any, what: str, limit: float, message: str, notice: Any,
               peers: Sequence[int] | None) -> str:
  """A timed-out wait's message: `message` (or one of its own), then who is missing."""
  text = message or (
      f"world rank {MPI.COMM_WORLD.Get_rank()} waited {limit:.0f} s in {what}, and not every"
      f" rank it needs came. Raise {native.WAIT_TIMEOUT_ENV}=<seconds> if a rank is only slow.")
  there = notice.alongside()  # nothing when notices are off or the bound came first
  missing = [w for w in _world_peers(comm, peers) if w not in there]
  if notice.told() and missing:
    text += (f" Waiting in it too: world ranks {there}; not in it: world ranks {missing}, alive"
             " (none exited) but in their own code, stuck, or waiting where this rank was not"
             " told (a step of another communicator).")
  return text


def _scope(uid: int, message: tuple[int, int, int] | None) -> int:
  """The operation this wait's notices name: the communicator's `uid`, or for a message a hash
  of it, both ranks and the tag (0, unknown: any tag, or no uid)."""
  if not uid or message is None:
    return int(uid)
  if message[2] < 0:
    return 0
  text = repr((int(uid), *(int(x) for x in message))).encode()
  return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") or 1


def _world_peers(comm: Any, peers: Sequence[int] | None) -> list[int]:
  """The world ranks of `peers` of `comm` (default: every other rank) that its MPI
  communicator holds (a communicator emulated for compiling, `lab.aot`, holds fewer)."""
  return [w for r, w in enumerate(world_ranks(comm.mpi_comm))
          if r != comm.rank and (peers is None or r in peers)]


def _never_meet(what: str, peer: int, theirs: str, in_step: bool) -> None:
  """Raises the error of a host round and a peer's wait (in a step's exchange, or in a host
  round of another communicator) that need each other."""
  me = MPI.COMM_WORLD.Get_rank()
  if in_step:
    why = ("one rank reached a step's exchange, the other a host round of mnjax: the ranks"
           " run different programs). Every rank must call mnjax's steps, collectives and"
           " checks in the same order: look for a condition on the rank, a loop or a model"
           " that differs between ranks.")
  else:
    why = ("two host operations that cannot be one: the rounds of two communicators that"
           " share these ranks, a message and a collective, or a send and a recv of other"
           " tags, each rank blocked in the one the other is not in). Ranks must enter their"
           " host operations in one order (the job's communicator and comm.split(...)'s"
           " alike), each send meeting a recv of its tag: look for a condition on the rank"
           " that swaps or skips one.")
  message = (f"world rank {me} waits in {what}, which needs world rank {peer}, while world"
             f" rank {peer} waits for this rank in {theirs}: the two can never meet ({why}")
  # Said now, as the peer (which names the same two waits at about the same time) does; then
  # a moment (on a loaded machine, seconds: kSayingPause in wait_notices.h) for the peer to
  # say it too before this error ends the job.
  print(f"mnjax: {message}", file=sys.stderr, flush=True)
  time.sleep(3.0)
  raise RuntimeError(message)
