"""A step's exchange timed from the in-step MPI handlers' own events, not as the difference of
two step times: what ``python -m lab.bench cluster`` compares with the link model.

The handlers stamp each collective from its post to its completion (the timeline's ring,
`mnjax.comm._instep._recorder`; switching it on needs no new trace). Matched across ranks in
call order, one collective's exchange runs from its last rank's arrival to its last rank's
completion: the bytes' time without the other ranks' wait for the last one, and without
what the early ranks' bytes moved before it came (the late rank's own span misses that).
A step's exchange is the union of those intervals. The ranks' stamps are compared as they
are: the emulated nodes (`lab.cluster`) share one kernel clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["exchange_seconds", "merged", "spans"]

_MARKS = (3, 4)   # the handlers' step begin / end marks (`recorder.NATIVE_KINDS`): no exchange


def spans(events: np.ndarray) -> list[tuple[int, int]]:
  """``(start_ns, end_ns)`` of each collective in `events` (`recorder.EVENT_DTYPE`), in the
  order they started, step marks left out."""
  return sorted((int(s), int(t)) for s, t, k in
                zip(events["start_ns"], events["end_ns"], events["kind"]) if k not in _MARKS)


def merged(spans_by_rank: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
  """The union of each collective's ``[last arrival, last completion]`` (ns), as disjoint
  intervals in time order, the i-th span of every rank being one collective.

  Example:
    >>> ms = 10**6
    >>> rank0 = [(0, 10 * ms), (20 * ms, 21 * ms)]   # arrived first at the first: waited
    >>> rank1 = [(6 * ms, 9 * ms), (20 * ms, 22 * ms)]
    >>> [(s // ms, t // ms) for s, t in merged([rank0, rank1])]
    [(6, 10), (20, 22)]
  """
  counts = {len(s) for s in spans_by_rank}
  if len(counts) != 1:
    raise RuntimeError(f"merged: the ranks recorded {sorted(counts)} collectives: they ran "
                       "different steps")
  lasts = sorted((max(s[i][0] for s in spans_by_rank), max(s[i][1] for s in spans_by_rank))
                 for i in range(counts.pop()))
  out: list[tuple[int, int]] = []
  for s, t in lasts:
    if out and s <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], t))
    else:
      out.append((s, t))
  return out


def exchange_seconds(state: Any, run: Callable[[Any], Any], mpi_comm, *, windows: int,
                     steps: int) -> tuple[float, float | None, Any]:
  """``(seconds of exchange per step, seconds the link idles between two steps' exchanges,
  state)``: medians over `windows` of `steps` steps each (local SGD: a whole number of its
  rounds). A window's exchange is its `merged` intervals' total over the ranks of
  `mpi_comm` divided by `steps`; its idle times, its ``steps - 1`` longest gaps between
  them (None with one step per window). `run` is compiled already; collective over
  `mpi_comm`.

  Example (a step without collectives: no exchange):
    >>> exchange_seconds(1.0, lambda s: s * 2, comm.mpi_comm, windows=2, steps=3)
    (0.0, None, 64.0)
  """
  from mnjax.comm._instep import _recorder as recorder
  per_step, idle = [], []
  jax.block_until_ready(state)
  for _ in range(windows):
    recorder.set_active(True)
    try:
      recorder.drain()
      mpi_comm.Barrier()
      for _ in range(steps):
        state = run(state)
      jax.block_until_ready(state)
      events, _, lost = recorder.drain()
    finally:
      recorder.set_active(False)
    if mpi_comm.allreduce(lost):
      raise RuntimeError("exchange_seconds: the handlers' ring lost events: fewer steps")
    intervals = merged(mpi_comm.allgather(spans(events)))
    per_step.append(sum(t - s for s, t in intervals) / 1e9 / steps)
    gaps = sorted(b[0] - a[1] for a, b in zip(intervals, intervals[1:]))
    idle += [g / 1e9 for g in gaps[max(len(gaps) - (steps - 1), 0):]] if steps > 1 else []
  return statistics.median(per_step), (statistics.median(idle) if idle else None), state
