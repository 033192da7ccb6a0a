"""`Timeline`: every collective on every rank, on one time axis, as one Chrome/Perfetto trace.

Rank 0 gathers the events (`mnjax.comm._instep._recorder`) on aligned clocks (`_clock`), splits
waits from exchanges (`_straggler`), writes the trace (`_trace`); docs/design/timeline.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _recorder as recorder
from mnjax.guard._timeline import _straggler as straggler
from mnjax.guard._timeline._clock import estimate_offsets
from mnjax.guard._timeline._trace import trace_events

__all__ = ["ENV", "Timeline", "from_env", "last_report"]

#: The environment variable `lab.runner.train_loop` reads: a trace path turns the timeline on.
ENV = "MNJAX_TIMELINE"

_LAST: dict[str, Any] = {"report": None}

#: A refreshed clock estimate is taken when its error is under this or under the current one.
_ACCEPT_ERROR_NS = 100_000


def last_report() -> dict | None:
  """Rank 0's most recent straggler report in this process (None before the first).

  Example:
    >>> last_report() is None or "ranks" in last_report()
    True
  """
  return _LAST["report"]


def _check_path(path: str) -> str:
  """'' when rank 0 can write `path` (its folder is created), else why not."""
  try:
    p = Path(path)
    if p.is_dir():
      return f"{path} is a directory"
    p.parent.mkdir(parents=True, exist_ok=True)
    existed = p.exists()
    with open(p, "a"):
      pass
    if not existed:
      p.unlink()
    return ""
  except OSError as error:
    return f"{type(error).__name__}: {error}"


class Timeline:
  """Records every collective of every rank; rank 0 writes a Chrome/Perfetto trace at `close`.

  Collective: create, `end_epoch`, `report` and `close` on every rank; the path is checked at
  creation. Use it as a context manager; call `step` as the host reaches each step.

  Args:
    path: where rank 0 writes the trace JSON (open it in https://ui.perfetto.dev).
    max_events: the most events kept; beyond it the oldest steps are dropped.
    clock_rounds: ping-pong rounds per clock estimate.
    verbose: rank 0 prints the clock alignment, and the straggler report at `close`.

  Example:
    >>> with mnjax.guard.Timeline(comm, "runs/timeline.json", verbose=False) as timeline:
    ...   for step in range(2):
    ...     timeline.step(step)
    ...     params = mnjax.broadcast({"w": jnp.ones(3)}, comm)   # recorded, like any collective
    >>> import json
    >>> sorted(json.load(open("runs/timeline.json")))
    ['displayTimeUnit', 'otherData', 'traceEvents']
  """

  def __init__(self, comm: Communicator, path: str | os.PathLike, *,
               max_events: int = 1_000_000, clock_rounds: int = 16, verbose: bool = True,
               _clock_shift_ns: int = 0):
    check_communicator(comm, "Timeline")
    if not isinstance(max_events, int) or max_events < 1:
      raise ValueError(f"Timeline: max_events must be an int >= 1, got {max_events!r}.")
    self.comm, self.path, self.verbose = comm, os.fspath(path), verbose
    self.max_events, self._rounds, self._shift = max_events, clock_rounds, int(_clock_shift_ns)
    self._mpi = comm.mpi_comm.Dup()  # collective; the timeline's own traffic only
    problem = _check_path(self.path) if comm.rank == 0 else ""
    problem = self._mpi.bcast(problem, root=0)
    already = self._mpi.allreduce(int(recorder.active()))
    if problem or already:
      self._mpi.Free()
      if already:
        raise RuntimeError("Timeline: a timeline is already recording in this job; close it"
                           " (or unset MNJAX_TIMELINE) before opening another.")
      raise ValueError(
          f"Timeline: rank 0 cannot write the trace to {self.path!r} ({problem}). Pass a path"
          f" in a writable folder (or set {ENV} to one); nothing was recorded.")
    channels = [comm.device_comm, *comm.device_comms, *comm.node_comms]
    from mnjax.comm._instep._primitives import _handle  # noqa: PLC0415 (the lowerings' handles)
    self._channels = {_handle(c): i for i, c in reversed(list(enumerate(channels)))}
    self._seq: dict[Any, int] = {}
    self._runs: dict[tuple, int] = {}
    self._last_run: dict[Any, tuple] = {}
    self._rows: list[tuple] = []        # this rank's, since the last gather
    self._marks: dict[int, list[int]] = {}  # step -> [begin, end] (local clock)
    self._host_steps: dict[int, list[int]] = {}  # step -> [dispatched, next dispatched]
    self._epochs: list[tuple[int, int, int]] = []
    self._epoch_start: tuple[int, int] | None = None
    self._all_rows: list[list[tuple]] = [[] for _ in range(comm.size)]  # rank 0
    self._all_steps: list[dict] = [{} for _ in range(comm.size)]
    self._all_epochs: list[list] = [[] for _ in range(comm.size)]
    self._dropped: list[int] = []
    self._lost = 0
    self._host_step = -1
    self._offset, self._error = 0, 0
    self._estimates: list[tuple[float, float]] = []
    self._align()
    recorder.set_active(True)
    self.closed = False

  # -- clocks ------------------------------------------------------------------------------

  def now(self) -> int:
    """This rank's timeline clock (ns; with the test-only shift)."""
    return recorder.now_ns() + self._shift

  def _align(self) -> None:
    offsets, errors = estimate_offsets(self._mpi, self.now, rounds=self._rounds)
    self._estimates.append((float(np.abs(offsets).max()) / 1e3, float(errors.max()) / 1e3))
    # A refresh measured on a busy machine (a long round trip) keeps the previous estimate.
    if self._estimates[1:] and errors.max() > max(self.errors.max(), _ACCEPT_ERROR_NS):
      return
    self._offset, self._error = int(offsets[self.comm.rank]), int(errors[self.comm.rank])
    self.offsets, self.errors = offsets, errors
    if self.verbose and self.comm.rank == 0 and self.comm.size > 1 and len(self._estimates) == 1:
      print(f"mnjax timeline: clocks aligned to rank 0: offsets up to"
            f" {np.abs(offsets).max() / 1e3:.1f} us, error <= {errors.max() / 1e3:.1f} us",
            flush=True)

  def _aligned(self, local_ns: int) -> int:
    return int(local_ns) + self._shift + self._offset

  # -- recording ---------------------------------------------------------------------------

  def step(self, n: int) -> None:
    """The host reaches step `n` (before dispatching it); collects the events so far (local)."""
    t = self.now()
    if self._host_step in self._host_steps:
      self._host_steps[self._host_step][1] = t
    self._host_step = int(n)
    self._host_steps[int(n)] = [t, t]
    if getattr(self, "_epoch_first", 0) is None:
      self._epoch_first = int(n)
    recorder.set_step(n)
    self._collect()

  def pause(self) -> None:
    """Collects what was recorded and stops recording (local); `resume` undoes it."""
    self._collect()
    recorder.set_active(False)

  def resume(self) -> None:
    """Records again after `pause` (local)."""
    if not self.closed:
      recorder.set_active(True)

  def begin_epoch(self, epoch: int) -> None:
    """Epoch `epoch` starts (local)."""
    self._epoch_start = (int(epoch), self._aligned(recorder.now_ns()))
    self._epoch_first: int | None = None

  def end_epoch(self, epoch: int) -> dict | None:
    """Epoch `epoch` ended (collective): gathers, realigns clocks, returns rank 0's report."""
    first = None
    if self._epoch_start is not None and self._epoch_start[0] == epoch:
      self._epochs.append((int(epoch), self._epoch_start[1], self._aligned(recorder.now_ns())))
      first = self._epoch_first
    self._gather()
    self._align()
    if self.comm.rank != 0:
      return None
    steps = [{s: v for s, v in d.items() if first is None or s >= first}
             for d in self._all_steps]
    return self._report(steps)

  def _collect(self) -> None:
    events, host, lost = recorder.drain()
    self._lost += lost
    for e in events:
      kind = recorder.NATIVE_KINDS[int(e["kind"])]
      if kind.startswith("step"):
        mark = self._marks.setdefault(int(e["step"]), [e["start_ns"], e["start_ns"]])
        if kind == "step begin":
          mark[0] = min(mark[0], e["start_ns"])
        else:
          mark[1] = max(mark[1], e["end_ns"])
        continue
      # The n-th call on one communicator is the same collective on every rank.
      channel = (("rank", self.comm.rank) if kind in recorder.POINT_TO_POINT or not e["comm"]
                 else self._channels.get(int(e["comm"]), ("comm", int(e["comm"]))))
      info = recorder.tag_info(int(e["tag"]))
      label, bucket, logical = info if info else (kind, -1, int(e["bytes"]))
      self._row(channel, label, bucket, logical, int(e["bytes"]), int(e["step"]),
                int(e["start_ns"]), int(e["end_ns"]), int(e["tag"]))
    for kind, start, end, nbytes, step in host:
      self._row(-1, kind, -1, nbytes, nbytes, step, start, end, 0)
    self._limit()

  def _row(self, channel, kind, bucket, nbytes, wire, step, start, end, tag) -> None:
    seq = self._seq.get(channel, 0)
    self._seq[channel] = seq + 1
    group = None
    if tag:  # consecutive calls with one tag on a channel: one collective (per channel run)
      if self._last_run.get(channel) != (tag, step, seq - 1):
        self._runs[(channel, tag, step)] = self._runs.get((channel, tag, step), -1) + 1
      self._last_run[channel] = (tag, step, seq)
      group = (step, tag, self._runs[(channel, tag, step)])
    self._rows.append((channel, seq, group, kind, bucket, nbytes, wire, step,
                       self._aligned(start), self._aligned(end)))

  def _limit(self) -> None:
    """Keeps this rank's events under `max_events`, dropping the oldest steps."""
    if len(self._rows) + sum(len(x) for x in self._all_rows) <= self.max_events:
      return
    rows = self._rows + sum(self._all_rows, [])
    steps = sorted({r[straggler.STEP] for r in rows})
    counts = np.cumsum([0] + [sum(1 for r in rows if r[straggler.STEP] == s) for s in steps])
    k = int(np.searchsorted(counts, len(rows) - self.max_events))  # drop steps[:k]
    cut = steps[min(k, len(steps) - 1)]  # the last step stays, even alone over the limit
    keep = lambda r: r[straggler.STEP] >= cut  # noqa: E731
    self._dropped.append(int(cut))
    self._rows = [r for r in self._rows if keep(r)]
    self._all_rows = [[r for r in rows_r if keep(r)] for rows_r in self._all_rows]
    self._marks = {s: v for s, v in self._marks.items() if s >= cut}
    self._all_steps = [{s: v for s, v in d.items() if s >= cut} for d in self._all_steps]
    if self.verbose and self.comm.rank == 0 and len(self._dropped) == 1:
      print(f"mnjax timeline: over {self.max_events} events: keeping the last steps only"
            f" (steps before {cut} dropped; the trace says so)", flush=True)

  def _steps(self) -> dict[int, tuple[int, int]]:
    """This rank's steps: the step marks (CPU), else the host's dispatch intervals."""
    if self._marks:
      return {s: (self._aligned(b), self._aligned(e)) for s, (b, e) in self._marks.items()}
    return {s: (b + self._offset, e + self._offset) for s, (b, e) in self._host_steps.items()
            if e > b}

  def _gather(self) -> None:
    self._collect()
    mine = (self._rows, self._steps(), self._lost, self._dropped, self._epochs)
    everyone = self._mpi.gather(mine, root=0)
    self._rows, self._marks, self._lost, self._epochs = [], {}, 0, []
    self._host_steps = {s: v for s, v in self._host_steps.items() if s == self._host_step}
    if self.comm.rank == 0:
      for r, (rows, steps, lost, dropped, epochs) in enumerate(everyone):
        self._all_rows[r].extend(rows)
        self._all_steps[r].update(steps)
        self._all_epochs[r].extend(epochs)
        self._lost += lost
        self._dropped.extend(d for d in dropped if d not in self._dropped)
      self._limit()

  def _report(self, steps: list[dict] | None = None) -> dict:
    rep = straggler.report(self._all_rows, self._all_steps if steps is None else steps)
    _LAST["report"] = rep
    return rep

  def report(self) -> dict:
    """The straggler report of every step kept so far, on every rank (collective).

    Example:
      >>> with mnjax.guard.Timeline(comm, "runs/t.json", verbose=False) as timeline:
      ...   report = timeline.report()
      >>> sorted(report)
      ['collectives', 'ranks', 'steps', 'straggler']
    """
    self._gather()
    return self._mpi.bcast(self._report() if self.comm.rank == 0 else None, root=0)

  # -- the end -----------------------------------------------------------------------------

  def close(self, *, failed: bool = False) -> dict | None:
    """Stops recording; rank 0 writes the trace and returns the straggler report. Collective,
    except with ``failed=True`` (rank 0's own events only, without waiting)."""
    if self.closed:
      return None
    self.closed = True
    if failed:
      self._collect()
      self._all_rows[0].extend(self._rows)
      self._all_steps[0].update(self._steps())
      self._all_epochs[0].extend(self._epochs)
    else:
      self._gather()
    recorder.set_active(False)
    if not failed:
      self._mpi.Free()
    if self.comm.rank != 0:
      return None
    rep = self._report()
    per_rank, _ = straggler.collectives(self._all_rows)
    events = trace_events(per_rank, self._all_steps, self._all_epochs)
    other = {"clock_offsets_us": [float(x) / 1e3 for x in self.offsets],
             "clock_errors_us": [float(x) / 1e3 for x in self.errors],
             "clock_estimates_us": self._estimates, "straggler_report": rep,
             "events_lost_by_the_handlers' ring": self._lost,
             "gpu_note": "on GPUs the in-step collectives run in mpi4jax's or XLA's own code:"
                         " they are named by jax.named_scope('mnjax/...') in a jax.profiler"
                         " trace, not here; steps are then the host's dispatch intervals"}
    if self._dropped:
      other["dropped"] = (f"over max_events={self.max_events}: kept the last steps only,"
                          f" from step {max(self._dropped)} on")
    if failed:
      other["incomplete"] = "the run failed: rank 0's events only"
    tmp = f"{self.path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, f)
    os.replace(tmp, self.path)
    if self.verbose:
      print(f"mnjax timeline: {len(events)} trace events from {self.comm.size} rank(s) in"
            f" {self.path}" + (f" ({other['dropped']})" if self._dropped else ""), flush=True)
      print(straggler.format_report(rep), flush=True)
    return rep

  def __enter__(self) -> Timeline:
    return self

  def __exit__(self, kind, value, tb) -> None:
    self.close(failed=kind is not None)


def from_env(comm: Communicator, **kwargs) -> Timeline | None:
  """A `Timeline` writing to ``$MNJAX_TIMELINE``, or None when it is unset or empty.

  Example:
    >>> from_env(comm) is None      # MNJAX_TIMELINE is not set here
    True
  """
  path = os.environ.get(ENV, "")
  return Timeline(comm, path, **kwargs) if path else None
