"""The GPipe schedule logic (pure Python, no MPI): timetable, per-rank order, deadlock
check and the bubble, counted in idle slots, against (S - 1) / (M + S - 1)."""

import pytest

from mnjax.model_parallel import (
    Action,
    ScheduleError,
    bubble_fraction,
    gpipe,
    idle_fraction,
    programs,
    simulate,
)

CASES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 6), (4, 8), (4, 32), (8, 3)]


@pytest.mark.parametrize(("stages", "micro"), CASES)
def test_the_timetable_and_the_executed_programs_idle_as_the_formula(stages, micro):
  table = gpipe(stages, micro)
  assert len(table) == 2 * (micro + stages - 1)
  work = [a for slot in table for a in slot if a is not None]
  assert sorted(work) == sorted(Action(k, s, m) for k in "FB" for s in range(stages)
                                for m in range(micro))
  # Each stage's backward of a micro-batch comes after the forward of it everywhere downstream.
  when = {a: t for t, slot in enumerate(table) for a in slot if a is not None}
  for s in range(stages):
    for m in range(micro):
      assert when[Action("F", s, m)] == s + m
      assert all(when[Action("B", s, m)] > when[Action("F", d, m)] for d in range(s, stages))
  assert idle_fraction(table) == pytest.approx(bubble_fraction(stages, micro))

  ranks = list(range(stages))
  run = simulate(programs(ranks, micro), ranks)  # blocking sends, unit costs
  assert max(e.end for e in run) == 2 * (micro + stages - 1)
  assert idle_fraction(run) == pytest.approx(bubble_fraction(stages, micro))


def test_unequal_stage_costs_make_the_slowest_stage_the_clock():
  ranks = [0, 1, 2]
  run = simulate(programs(ranks, 8), ranks, costs={"F": [1, 3, 1], "B": [2, 6, 2]})
  # The slow stage runs its 8 forwards back to back, waits for stage 2's F and B of the
  # last micro-batch, then its 8 backwards back to back; stage 0's last B ends the step.
  busy = sorted((e.start, e.end) for e in run if e.rank == 1)
  assert busy[0] == (1, 4) and busy[7] == (22, 25) and busy[8] == (28, 34)
  assert all(a[1] == b[0] for a, b in zip(busy, busy[1:]) if a[1] != 25)
  assert max(e.end for e in run) == 1 + 8 * 3 + 1 + 2 + 8 * 6 + 2
  assert idle_fraction(run) > bubble_fraction(3, 8)


def test_programs_run_forward_in_slot_order_then_backward_reversed():
  prog = programs([0, 1, 0], 2)
  assert [f"{a.kind}{a.stage}.{a.micro}" for a in prog[0]] == [
      "F0.0", "F0.1", "F2.0", "F2.1", "B2.1", "B2.0", "B0.1", "B0.0"]
  assert [f"{a.kind}{a.stage}.{a.micro}" for a in prog[1]] == [
      "F1.0", "F1.1", "B1.1", "B1.0"]


def test_a_chain_that_comes_back_to_a_rank_deadlocks_with_micro_batches_and_is_named():
  with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 .*rank 1 .*\[0, 1, 0\]"):
    simulate(programs([0, 1, 0], 2), [0, 1, 0])
  simulate(programs([0, 1, 0], 2), [0, 1, 0], eager=True)  # small messages get through
  run = simulate(programs([0, 1, 0], 1), [0, 1, 0])        # no micro-batches: sequential
  assert max(e.end for e in run) == 6


def test_messages_in_another_order_are_a_mismatch_not_a_hang():
  prog = programs([0, 1], 2)
  prog[1] = [prog[1][1], prog[1][0], *prog[1][2:]]  # rank 1 takes micro-batch 1 first
  with pytest.raises(ScheduleError, match=r"rank 0 sends \('F', 1, 0\) to rank 1.*\('F', 1, 1\)"):
    simulate(prog, [0, 1])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_are_refused(bad):
  with pytest.raises(ValueError, match="must be an int >= 1"):
    bubble_fraction(2, bad)
  with pytest.raises(ValueError, match="must be an int >= 1"):
    gpipe(bad, 2)
