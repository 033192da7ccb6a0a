"""Stall watchdog: ranks that stop reaching the same step are reported, then the job aborts.

Each rank's thread sends rank 0 its step and in-step collective counts every ``interval`` s
over a private communicator; rank 0 answers with a heartbeat (docs/design/failures.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mnjax.comm import _failfast as failfast
from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _native as native
from mnjax.guard import _timeline as timeline
from mnjax.guard._timeline import _straggler as straggler

__all__ = ["Watchdog"]

_TAG = 7301
_RUNNING, _DONE = 0, 1

#: Seconds in a collective that a finished rank never entered before it is reported.
FINISHED_GRACE = 5.0


class Watchdog:
  """Reports ranks that fall behind or go silent, then aborts every rank (collective to create).

  Args:
    timeout: seconds a rank may take to reach a step after the first rank reached it (the
      skew between ranks, not the length of a step or a compilation).
    heartbeat_timeout: seconds without any message from a rank (or, on the others, from
      rank 0) before it counts as dead.
    interval: seconds between heartbeats.
    on_stall: called with the report instead of `mnjax.comm.abort` (print, ``MPI_Abort``).

  Example:
    >>> state = 0
    >>> with mnjax.Watchdog(comm, timeout=300) as watchdog:
    ...   for step in range(3):
    ...     watchdog.step(step)
    ...     state = state + 1            # state, metrics = train_step(state, batch)
    >>> state
    3
  """

  def __init__(self, comm: Communicator, *, timeout: float = 300.0,
               heartbeat_timeout: float = 60.0, interval: float = 1.0,
               on_stall: Callable[[str], None] | None = None):
    check_communicator(comm, "Watchdog")
    for name, value in (("timeout", timeout), ("heartbeat_timeout", heartbeat_timeout),
                        ("interval", interval)):
      if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Watchdog: {name} must be a positive number of seconds, got {value!r}.")
    if heartbeat_timeout < 3 * interval:
      raise ValueError(
          f"Watchdog: heartbeat_timeout ({heartbeat_timeout} s) must be at least 3 heartbeat"
          f" intervals ({3 * interval} s), or a busy rank would be taken for a dead one.")
    if comm.size > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
      raise RuntimeError(
          "Watchdog: MPI was initialised without MPI_THREAD_MULTIPLE, which the watchdog's"
          " thread needs. Leave mpi4py.rc.thread_level at its default ('multiple').")
    self.comm = comm
    self.timeout = float(timeout)
    self.heartbeat_timeout = float(heartbeat_timeout)
    self.interval = float(interval)
    self._on_stall = on_stall or failfast.abort
    self._step = -1
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._mpi = comm.mpi_comm.Dup() if comm.size > 1 else None  # collective
    self._requests: list[MPI.Request] = []

  # -- main thread -------------------------------------------------------------------------

  def step(self, n: int) -> None:
    """Records that this rank has reached step `n` (call it once per step, any thread)."""
    self._step = int(n)

  def start(self) -> Watchdog:
    """Starts the thread (local). Returns self."""
    if self._mpi is not None and self._thread is None:
      target = self._monitor if self.comm.rank == 0 else self._report
      self._thread = threading.Thread(target=target, name="mnjax-watchdog", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    """Stops the thread and tells the peers this rank finished (local, idempotent)."""
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    peers = range(1, self.comm.size) if self.comm.rank == 0 else (0,)
    for peer in peers:
      self._send(peer, _DONE)
    MPI.Request.Waitall(self._requests)  # small messages: complete locally at once
    self._requests = []

  def __enter__(self) -> Watchdog:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # -- the thread --------------------------------------------------------------------------

  def _send(self, dest: int, flag: int) -> None:
    self._requests = [r for r in self._requests if not r.Test()]
    message = np.array([self._step, flag, *_collective_counts()], np.int64)
    self._requests.append(self._mpi.Isend(message, dest=dest, tag=_TAG))

  def _receive(self):
    """Every pending message: yields (source, [step, flag, entered, completed])."""
    status = MPI.Status()
    while self._mpi.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
      message = np.empty(4, np.int64)
      self._mpi.Recv(message, source=status.Get_source(), tag=_TAG)
      yield status.Get_source(), message

  def _report(self) -> None:
    """Ranks other than 0: send the step, watch rank 0's heartbeat and whether it finished."""
    heard, root_done, root_final = time.monotonic(), False, None
    view = _JobView(1, time.monotonic())  # this rank alone: when its counters last moved
    while not self._stop.wait(self.interval):
      if not root_done:
        self._send(0, _RUNNING)
      for _, message in self._receive():
        heard, root_done = time.monotonic(), root_done or message[1] == _DONE
        root_final = message if message[1] == _DONE else root_final
      now = time.monotonic()
      view.update(0, np.array([self._step, _RUNNING, *_collective_counts()]), now)
      silent = now - heard
      if not root_done and silent > self.heartbeat_timeout:
        self._on_stall(
            f"mnjax watchdog: rank {self.comm.rank} has not heard from rank 0 for"
            f" {silent:.0f} s (this rank is at step {self._step}); rank 0 died or is stuck."
            " Aborting all ranks.")
        return
      if root_final is not None:
        report = view.waiting_for_finished(
            now, {0: root_final}, self.timeout, names={0: self.comm.rank})
        if report:
          self._on_stall(report)
          return

  def _monitor(self) -> None:
    """Rank 0: collect every rank's progress, look for stalls, send heartbeats."""
    view = _JobView(self.comm.size, time.monotonic())
    while not self._stop.wait(self.interval):
      now = time.monotonic()
      for source, message in self._receive():
        view.update(source, message, now)
      view.update(0, np.array([self._step, _RUNNING, *_collective_counts()]), now)
      report = view.stall_report(now, self.timeout, self.heartbeat_timeout)
      if report:  # with a timeline: who has been arriving last (`mnjax.guard.Timeline`)
        self._on_stall(report + straggler.summary(timeline.last_report()))
        return
      for rank in np.flatnonzero(~view.done[1:]) + 1:
        self._send(int(rank), _RUNNING)


def _collective_counts() -> tuple[int, int]:
  """(entered, completed) in-step collectives of mnjax's CPU handlers; (0, 0) without them."""
  try:
    return native.collective_counts()
  except Exception:  # noqa: BLE001 (no compiler for the handlers: steps still count)
    return 0, 0


class _JobView:
  """Rank 0's picture of every rank: step, in-step collectives, when it last changed."""

  def __init__(self, size: int, now: float):
    self.steps = np.full(size, -1, np.int64)
    self.entered = np.zeros(size, np.int64)
    self.completed = np.zeros(size, np.int64)
    self.heard = np.full(size, now)
    self.moved = np.full(size, now)  # last change of the collective counters
    self.done = np.zeros(size, bool)
    self.last = np.zeros((size, 4), np.int64)  # each rank's last message
    self.first_reached: list[tuple[int, float]] = []  # (new highest step, when)

  def update(self, rank: int, message: np.ndarray, now: float) -> None:
    step, flag, entered, completed = (int(x) for x in message)
    self.last[rank] = message
    if (entered, completed) != (self.entered[rank], self.completed[rank]):
      self.moved[rank] = now
    self.steps[rank] = max(self.steps[rank], step)
    self.entered[rank], self.completed[rank] = entered, completed
    self.heard[rank] = now
    self.done[rank] |= flag == _DONE
    top = int(self.steps.max())
    if not self.first_reached or top > self.first_reached[-1][0]:
      self.first_reached.append((top, now))

  def waiting_for_finished(self, now: float, finished: dict[int, np.ndarray], timeout: float,
                           names: dict[int, int] | None = None) -> str:
    """A report if a running rank waits for a rank in `finished` that can never join; ''.
    `names` maps this view's indices to ranks (default: the same)."""
    names = names or {}
    out = []
    for r in range(len(self.steps)):
      if self.done[r]:
        continue
      stuck_for = now - self.moved[r]
      in_collective = self.entered[r] > self.completed[r]
      for d, (step, _, entered, _) in sorted(finished.items()):
        never_entered = in_collective and entered < self.entered[r]
        if never_entered and stuck_for > min(FINISHED_GRACE, timeout):
          out.append(
              f"rank {d} finished (after step {step} and {entered} in-step collectives)"
              f" while rank {names.get(r, r)} has waited {stuck_for:.0f} s in in-step"
              f" collective #{self.entered[r]} (at step {self.steps[r]}), which rank {d}"
              " never entered")
        elif (not in_collective and self.entered[r] == 0 and step < self.steps[r]
              and now - self._step_since(r) > timeout):  # no counters (GPU handlers)
          out.append(
              f"rank {d} finished after step {step} while rank {names.get(r, r)} is at step"
              f" {self.steps[r]} and has not moved for {now - self._step_since(r):.0f} s")
    if not out:
      return ""
    return ("mnjax watchdog: " + "; ".join(out) + ". A finished rank can never join a"
            " collective: the ranks ran different numbers of steps or collectives (a loop,"
            " a condition or a model that differs between ranks). Aborting all ranks.")

  def _step_since(self, rank: int) -> float:
    """When the furthest rank first reached `rank`'s current step (for the GPU case)."""
    return next((t for s, t in self.first_reached if s >= self.steps[rank]), self.heard[rank])

  def stall_report(self, now: float, timeout: float, heartbeat_timeout: float) -> str:
    """What is wrong, naming ranks and steps; '' while every running rank keeps up."""
    running = [r for r in range(len(self.steps)) if not self.done[r]]
    finished = {r: self.last[r] for r in range(len(self.steps)) if self.done[r]}
    blocked = self.waiting_for_finished(now, finished, timeout) if finished else ""
    if blocked:
      return blocked
    problems = []
    silent = [r for r in running if now - self.heard[r] > heartbeat_timeout]
    if silent:
      problems.append("no message from " + ", ".join(
          f"rank {r} (at step {self.steps[r]}) for {now - self.heard[r]:.0f} s" for r in silent)
          + ": the process died or holds the Python GIL")
    # Ranks stuck inside an in-step collective, and the ranks that never entered it.
    waiting = [r for r in running if r not in silent and self.entered[r] > self.completed[r]
               and now - self.moved[r] > timeout]
    if waiting:
      number = int(self.entered[waiting[0]])
      absent = [r for r in running if self.entered[r] < number]
      problems.append(
          f"ranks {waiting} have waited over {timeout:.0f} s in in-step collective #{number}"
          f" (at step {self.steps[waiting[0]]}); "
          + (", ".join(f"rank {r} has not entered it (at step {self.steps[r]}, after"
                       f" {self.entered[r]} collectives)" for r in absent) if absent else
             "every rank has entered it: they wait in different collectives, or MPI is stuck"))
    # Ranks that have not reached a step some rank passed `timeout` seconds ago.
    top = int(self.steps.max())
    for r in running:
      if r in silent or r in waiting or (waiting and self.entered[r] < number):
        continue
      since = next((t for s, t in self.first_reached if s > self.steps[r]), None)
      if since is not None and now - since > timeout:
        problems.append(f"rank {r} has not reached step {self.steps[r] + 1}"
                        f" {now - since:.0f} s after the first rank did (the furthest"
                        f" is at step {top})")
    if not problems:
      return ""
    return (f"mnjax watchdog: ranks are not keeping up (timeout {timeout:.0f} s, heartbeat"
            f" timeout {heartbeat_timeout:.0f} s): " + "; ".join(problems) + ". Aborting all"
            " ranks; the stacks of the ranks named show where they are.")
