"""Who waited for whom: rows matched across ranks by ``(channel, seq)``, each rank's wait (the
last arrival minus its own), the straggler report. A row is one handler call or host
collective on one rank (equal ``group`` s make one collective)::

    (channel, seq, group, kind, bucket, bytes, wire_bytes, step, start_ns, end_ns)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Collective", "collectives", "format_report", "report"]

CHANNEL, SEQ, GROUP, KIND, BUCKET, BYTES, WIRE, STEP, START, END = range(10)


class Collective(dict):
  """One logical collective on one rank: kind, bucket, bytes, wire_bytes, step, start, end,
  wait (ns), anchor (its first call's ``(channel, seq)``, the same on every rank)."""


def _waits(rows_by_rank: list[list[tuple]]) -> tuple[dict, dict]:
  """``(last arrival, arrivals)`` by ``(channel, seq)``, of the calls every rank recorded."""
  arrivals: dict[tuple, dict[int, int]] = {}
  for rank, rows in enumerate(rows_by_rank):
    for row in rows:
      arrivals.setdefault((row[CHANNEL], row[SEQ]), {})[rank] = row[START]
  size = len(rows_by_rank)
  complete = {k: v for k, v in arrivals.items() if len(v) == size}
  return {k: max(v.values()) for k, v in complete.items()}, complete


def collectives(rows_by_rank: list[list[tuple]]) -> tuple[list[list[Collective]], dict]:
  """Per rank, its logical collectives with their waits; and the arrivals of every
  matched call, by ``(channel, seq)``."""
  last, arrivals = _waits(rows_by_rank)
  out = []
  for rows in rows_by_rank:
    groups: dict[Any, Collective] = {}
    per_channel_wait: dict[Any, dict] = {}
    for row in rows:
      key = row[GROUP] if row[GROUP] is not None else ("call", row[CHANNEL], row[SEQ])
      wait = max(0, last.get((row[CHANNEL], row[SEQ]), row[START]) - row[START])
      c = groups.get(key)
      if c is None:
        c = groups[key] = Collective(
            kind=row[KIND], bucket=row[BUCKET], bytes=row[BYTES], wire_bytes=0, step=row[STEP],
            start=row[START], end=row[END], anchor=(row[CHANNEL], row[SEQ]))
      c["start"], c["end"] = min(c["start"], row[START]), max(c["end"], row[END])
      c["wire_bytes"] += row[WIRE]
      waits = per_channel_wait.setdefault(key, {})
      waits[row[CHANNEL]] = waits.get(row[CHANNEL], 0) + wait
    for key, c in groups.items():
      c["wait"] = min(max(per_channel_wait[key].values()), c["end"] - c["start"])
    out.append(sorted(groups.values(), key=lambda c: c["start"]))
  return out, arrivals


def _union(spans: list[tuple]) -> float:
  """The total length of the union of intervals ``(from, to)``.

  Example:
    >>> _union([(0, 300), (100, 300), (500, 600)])   # two overlapping waits count once
    400
  """
  total, end = 0, None
  for lo, hi in sorted(spans):
    if end is None or lo > end:
      total, end = total + hi - lo, hi
    elif hi > end:
      total, end = total + hi - end, hi
  return total


def report(rows_by_rank: list[list[tuple]], steps_by_rank: list[dict[int, tuple]]) -> dict:
  """The straggler report: per rank, how often it was a step's straggler and by how much
  (median, p95, ms), and the exchange's and the wait's share of its steps.
  `steps_by_rank[r]`: step -> (start_ns, end_ns) on rank r; only their collectives count.

  Example:
    >>> rows = [[(0, 0, None, "allreduce", -1, 8, 8, 0, 100, 900)],   # rank 0: waits
    ...         [(0, 0, None, "allreduce", -1, 8, 8, 0, 700, 900)]]   # rank 1: 600 ns late
    >>> r = report(rows, [{0: (0, 1000)}, {0: (0, 1000)}])
    >>> r["straggler"], r["ranks"][1]["last"], r["ranks"][0]["wait_share"]
    (1, 1, 0.6)
  """
  size = len(rows_by_rank)
  per_rank, arrivals = collectives(rows_by_rank)
  steps0 = steps_by_rank[0] if steps_by_rank else {}
  waited: dict[int, list[list]] = {}  # step -> per rank: (from, to) the others waited for it
  last_at = np.zeros(size, int)
  matched = 0
  for c in (per_rank[0] if per_rank else []):
    got = arrivals.get(c["anchor"])
    if got is None or size < 2 or c["step"] not in steps0:
      continue
    matched += 1
    ranked = sorted(got.items(), key=lambda kv: kv[1])
    (last_rank, t_last), (_, t_next) = ranked[-1], ranked[-2]
    last_at[last_rank] += 1
    waited.setdefault(c["step"], [[] for _ in range(size)])[last_rank].append((t_next, t_last))
  # A rank's lateness in a step: how long the others waited for it alone, the union of those
  # intervals (collectives in flight together, each waiting on the same delay, count it once).
  lateness = {step: np.array([_union(spans) for spans in per_rank])
              for step, per_rank in waited.items()}
  late: list[list[float]] = [[] for _ in range(size)]
  for per_step in lateness.values():
    late[int(np.argmax(per_step))].append(float(per_step.max()) / 1e6)
  ranks = []
  for r in range(size):
    steps = steps_by_rank[r]
    step_ns = sum(end - start for start, end in steps.values()) or 1
    busy = wait = 0
    for c in per_rank[r]:  # the part of each collective inside its step's span
      if c["step"] not in steps:
        continue
      start, end = steps[c["step"]]
      lo, hi = max(c["start"], start), min(c["end"], end)
      if hi > lo:
        busy += hi - lo
        wait += max(0, min(c["start"] + c["wait"], hi) - lo)
    ranks.append({
        "rank": r, "last": len(late[r]),
        "last_share": len(late[r]) / len(lateness) if lateness else 0.0,
        "late_median_ms": float(np.median(late[r])) if late[r] else 0.0,
        "late_p95_ms": float(np.percentile(late[r], 95)) if late[r] else 0.0,
        "last_collectives": int(last_at[r]),
        "exchange_share": (busy - wait) / step_ns if steps else 0.0,
        "wait_share": wait / step_ns if steps else 0.0,
        "steps": len(steps),
    })
  counts = [x["last"] for x in ranks]
  return {"collectives": matched, "steps": max((x["steps"] for x in ranks), default=0),
          "straggler": int(np.argmax(counts)) if lateness else None, "ranks": ranks}


def format_report(rep: dict) -> str:
  """Rank 0's lines for a `report`.

  Example:
    >>> print(format_report({"collectives": 0, "steps": 0, "straggler": None, "ranks": []}))
    mnjax straggler report: no collective matched across ranks
  """
  if not rep["collectives"] and not rep["steps"]:
    return "mnjax straggler report: no collective matched across ranks"
  lines = [f"mnjax straggler report ({rep['collectives']} collectives, {rep['steps']} steps):"]
  for x in rep["ranks"]:
    lines.append(
        f"  rank {x['rank']}: the straggler of {x['last_share']:6.1%} of steps, late by"
        f" {x['late_median_ms']:.3f} ms median, {x['late_p95_ms']:.3f} ms p95 (last at"
        f" {x['last_collectives']} collectives); exchange"
        f" {x['exchange_share']:6.1%}, wait {x['wait_share']:6.1%} of its steps")
  if rep["straggler"] is not None:
    s = rep["ranks"][rep["straggler"]]
    lines.append(f"  straggler: rank {rep['straggler']} (of {s['last_share']:.0%} of steps,"
                 f" {s['late_median_ms']:.3f} ms late median)")
  return "\n".join(lines)


def summary(rep: dict | None) -> str:
  """One sentence of a `report` for the watchdog's message ('' without one).

  Example:
    >>> summary(None)
    ''
  """
  if not rep or rep.get("straggler") is None:
    return ""
  s = rep["ranks"][rep["straggler"]]
  return (f" The timeline's last straggler report: rank {rep['straggler']} arrived last in"
          f" {s['last_share']:.0%} of {rep['steps']} steps, late by"
          f" {s['late_median_ms']:.1f} ms median ({s['late_p95_ms']:.1f} ms p95).")
