"""The timeline's offline pieces: the straggler report on known arrivals, the trace events,
and `python -m lab.timeline view` drawing a PNG (or saying why not)."""

import json

import pytest

from lab.timeline import __main__ as cli
from mnjax.guard._timeline import _straggler as straggler
from mnjax.guard._timeline._trace import trace_events

MS = 1_000_000


def three_ranks(steps=4):
  """Rows of 3 ranks: rank 2 arrives 5 ms late at the first of two collectives of every
  10 ms step (rank 1 10 us after rank 0)."""
  rows, spans = [[], [], []], [{}, {}, {}]
  for s in range(steps):
    t = s * 20 * MS
    for r in range(3):
      spans[r][s] = (t, t + 10 * MS)
      late = 5 * MS if r == 2 else r * 10_000
      rows[r].append((0, 2 * s, (s, 1, 0), "bucket allreduce", 0, 64, 64, s, t + 1 * MS + late,
                      t + 7 * MS))
      rows[r].append((0, 2 * s + 1, (s, 2, 0), "bucket allreduce", 1, 32, 32, s, t + 8 * MS,
                      t + 9 * MS))
  return rows, spans


def test_the_report_names_the_late_rank_and_splits_wait_from_exchange():
  rep = straggler.report(*three_ranks())
  assert rep["straggler"] == 2 and rep["steps"] == 4 and rep["collectives"] == 8
  late = rep["ranks"][2]
  assert late["last"] == 4 and late["last_share"] == 1.0
  assert late["late_median_ms"] == pytest.approx(5 - 0.01, abs=1e-6)  # vs the next latest
  assert rep["ranks"][0]["wait_share"] == pytest.approx(0.5, abs=0.01)  # 5 of 10 ms
  assert late["wait_share"] == pytest.approx(0.0, abs=0.01)
  assert late["exchange_share"] == pytest.approx(0.2, abs=0.01)  # 1 + 1 ms of 10


@pytest.fixture
def trace_file(tmp_path):
  rows, spans = three_ranks()
  per_rank, _ = straggler.collectives(rows)
  path = tmp_path / "trace.json"
  path.write_text(json.dumps({"traceEvents": trace_events(per_rank, spans, [[], [], []])}))
  return path


def test_view_draws_a_png_of_the_steps_asked_for(trace_file, tmp_path):
  out = tmp_path / "view.png"
  cli.main(["view", str(trace_file), "--steps", "2", "--out", str(out)])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  cli.main(["view", str(trace_file)])  # default: next to the trace
  assert trace_file.with_suffix(".png").exists()


def test_view_says_what_is_wrong_with_a_file_or_the_steps(trace_file, tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("[1, 2]")
  with pytest.raises(ValueError, match="not a Chrome trace"):
    cli.main(["view", str(bad)])
  with pytest.raises(ValueError, match=r"steps 40 \.\. 42 are not in the trace \(it holds"
                     r" steps 0 \.\. 3\)"):
    cli.main(["view", str(trace_file), "--first", "40"])
