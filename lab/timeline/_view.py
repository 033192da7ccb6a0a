"""A trace of `mnjax.guard.Timeline` drawn as one PNG: a row per rank, a few steps wide.

Each rank's row is its phase track (`mnjax/guard/_timeline/_trace.py`): compute, the wait
for the last peer, and the exchange, in three colours; dashed lines mark where steps start on
rank 0, and each step is labelled. The waits show at a glance who everybody waits for: the
straggler's row has almost none, and the others wait at the collectives it arrives late to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["COLOURS", "load", "render"]

#: Colour of each phase.
COLOURS = {"compute": "#4c9f70", "wait": "#d1495b", "exchange": "#2e86ab"}


def load(path: str | os.PathLike) -> dict:
  """The trace at `path`, checked to be one `mnjax.guard.Timeline` wrote.

  Example:
    >>> load("runs/timeline.json")["traceEvents"][0]["ph"]   # doctest: +SKIP
    'M'
  """
  try:
    trace = json.loads(Path(path).read_text())
  except (OSError, json.JSONDecodeError) as error:
    raise ValueError(
        f"lab.timeline: cannot read the trace {os.fspath(path)!r} ({error}).") from error
  if not isinstance(trace, dict) or "traceEvents" not in trace:
    raise ValueError(f"lab.timeline: {os.fspath(path)!r} is not a Chrome trace (no"
                     " 'traceEvents'); pass the JSON that MNJAX_TIMELINE wrote.")
  return trace


def render(path: str | os.PathLike, *, steps: int = 3, first: int | None = None,
           out: str | os.PathLike | None = None) -> str:
  """Draws `steps` consecutive steps from `first` (default: the second step in the trace,
  past the compilation of the first) into a PNG at `out` (default: the trace's path with
  ``.png``); returns its path.

  Example:
    >>> render("runs/timeline.json", steps=3)   # doctest: +SKIP
    'runs/timeline.png'
  """
  import matplotlib  # noqa: PLC0415 (an optional dependency, for this command only)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  trace = load(path)
  events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
  step_spans = [e for e in events if e.get("cat") == "step"]
  numbers = sorted({e["args"]["step"] for e in step_spans})
  if not numbers:
    raise ValueError(f"lab.timeline: {os.fspath(path)!r} holds no step; was it recorded"
                     " around a train loop?")
  if first is None:
    first = numbers[1] if len(numbers) > 1 else numbers[0]
  chosen = set(range(first, first + steps))
  if not chosen & set(numbers):
    raise ValueError(f"lab.timeline: steps {first} .. {first + steps - 1} are not in the"
                     f" trace (it holds steps {numbers[0]} .. {numbers[-1]}).")
  in_view = [e for e in step_spans if e["args"]["step"] in chosen]
  t0 = min(e["ts"] for e in in_view)
  t1 = max(e["ts"] + e["dur"] for e in in_view)
  ranks = sorted({e["pid"] for e in events})
  fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(ranks)))
  for row, rank in enumerate(ranks):
    for phase, colour in COLOURS.items():
      spans = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in events
               if e["pid"] == rank and e.get("cat") == phase
               and e["args"].get("step") in chosen]
      ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colour,
                     label=phase if row == 0 else None)
  for e in in_view:
    if e["pid"] == ranks[0]:
      x = (e["ts"] - t0) / 1e3
      ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
      ax.text(x, -0.42, f" step {e['args']['step']}", fontsize=8, va="bottom")
  ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
  ax.set_ylim(-0.6, len(ranks) - 0.1)
  ax.invert_yaxis()
  ax.set_xlim(0, (t1 - t0) / 1e3)
  ax.set_xlabel("ms")
  ax.legend(loc="upper right", ncol=3, fontsize=8, bbox_to_anchor=(1.0, 1.25))
  ax.set_title(f"{Path(path).name}: steps {min(chosen)} .. {max(chosen)}", loc="left", fontsize=9)
  fig.tight_layout()
  out = os.fspath(out) if out is not None else os.fspath(Path(path).with_suffix(".png"))
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out
