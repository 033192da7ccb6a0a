"""The timeline as Chrome trace events (read by Perfetto and chrome://tracing): complete events,
``pid`` = rank, a ``tid`` per track of `_TRACKS` (docs/design/timeline.md, "The trace")."""

from __future__ import annotations

__all__ = ["PHASES", "trace_events"]

#: The phase track's categories, in the order the viewer stacks them.
PHASES = ("compute", "wait", "exchange")
_TRACKS = ("epochs", "steps", "collectives", "phase", "host collectives")


def _x(name, cat, pid, tid, start, end, base, **args):
  return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
          "ts": (start - base) / 1e3, "dur": max(end - start, 0) / 1e3, "args": args}


def trace_events(per_rank: list[list[dict]], steps_by_rank: list[dict],
                 epochs_by_rank: list[list[tuple]]) -> list[dict]:
  """The trace events of every rank's collectives (`_straggler.collectives`),
  steps (step -> (start, end) ns) and epochs ((epoch, start, end) ns), times aligned.

  Example:
    >>> c = {"kind": "allreduce", "bucket": -1, "bytes": 8, "wire_bytes": 8, "step": 0,
    ...      "start": 200, "end": 900, "wait": 300, "anchor": (0, 0)}
    >>> events = trace_events([[c]], [{0: (0, 1000)}], [[]])
    >>> sorted({e["name"] for e in events if e["ph"] == "X"})
    ['allreduce', 'compute', 'exchange', 'step 0', 'wait']
  """
  starts = [c["start"] for rank in per_rank for c in rank]
  starts += [s for steps in steps_by_rank for s, _ in steps.values()]
  starts += [s for epochs in epochs_by_rank for _, s, _ in epochs]
  base = min(starts, default=0)
  out: list[dict] = []
  for rank, collectives in enumerate(per_rank):
    out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                "args": {"name": f"rank {rank}"}})
    out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                "args": {"sort_index": rank}})
    for tid, name in enumerate(_TRACKS):
      out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                  "args": {"name": name}})
    for epoch, start, end in epochs_by_rank[rank]:
      out.append(_x(f"epoch {epoch}", "epoch", rank, 0, start, end, base, epoch=epoch))
    steps = steps_by_rank[rank]
    for step, (start, end) in sorted(steps.items()):
      out.append(_x(f"step {step}", "step", rank, 1, start, end, base, step=step))
    for c in collectives:
      name = c["kind"] + (f" {c['bucket']}" if c["bucket"] >= 0 else "")
      host = c["anchor"][0] == -1
      out.append(_x(name, "collective", rank, 4 if host else 2, c["start"], c["end"], base,
                    op=c["kind"], bytes=c["bytes"], wire_bytes=c["wire_bytes"],
                    bucket=c["bucket"], step=c["step"], wait_us=c["wait"] / 1e3, host=host))
    out.extend(_phases(rank, collectives, steps, base))
  return out


def _phases(rank: int, collectives: list[dict], steps: dict, base: int) -> list[dict]:
  """Each step as compute / wait / exchange segments (uncovered time is compute)."""
  out = []
  by_step: dict[int, list[dict]] = {}
  for c in collectives:
    by_step.setdefault(c["step"], []).append(c)
  for step, (start, end) in sorted(steps.items()):
    cursor = start
    for c in sorted(by_step.get(step, []), key=lambda c: c["start"]):
      lo, hi = max(c["start"], cursor), min(c["end"], end)
      if hi <= lo:
        continue
      if lo > cursor:
        out.append(_x("compute", "compute", rank, 3, cursor, lo, base, step=step))
      split = min(max(c["start"] + c["wait"], lo), hi)
      if split > lo:
        out.append(_x("wait", "wait", rank, 3, lo, split, base, step=step))
      if hi > split:
        out.append(_x("exchange", "exchange", rank, 3, split, hi, base, step=step))
      cursor = hi
    if end > cursor:
      out.append(_x("compute", "compute", rank, 3, cursor, end, base, step=step))
  return out
