"""`lab.bench.aot_memory.largest_batch`: the search for the largest batch that fits, on a
fake compiler (a peak linear in the batch, or not monotonic), wherever the fit's guess lands."""

import pytest

from lab.bench.aot_memory import largest_batch

MEMORY = 100e9


def linear(b):
  return {"peak_bytes": 1e9 + b * 0.1e9}  # fits up to 990 images in MEMORY


def counted(peak):
  calls = []

  def compile_at(b):
    calls.append(b)
    return peak(b)
  return compile_at, calls


@pytest.mark.parametrize("shift", [-60, -20, -1, 0, 1, 20, 60])  # 12 compiles reach ~63 away
def test_the_boundary_is_found_from_a_guess_too_low_or_too_high(shift):
  # rows whose peaks are `shift` images off: the affine fit's guess is off by -shift
  rows = {32: linear(32 + shift), 64: linear(64 + shift)}
  compile_at, calls = counted(linear)
  r = largest_batch(compile_at, rows, MEMORY, search=True)
  assert abs(r["predicted"] - (990 - shift)) <= 1  # the fit's floor, in floating point
  assert (r["largest"], r["boundary_found"]) == (990, True), r
  assert len(calls) == len(set(calls)) <= 12  # each batch once, within the budget


def test_a_budget_too_small_says_the_boundary_was_not_found():
  rows = {32: linear(332), 64: linear(364)}  # a guess 300 images too low
  r = largest_batch(counted(linear)[0], rows, MEMORY, search=True, budget=3)
  assert r["largest"] is not None and r["largest"] < 990 and not r["boundary_found"], r


def test_a_failed_compile_counts_as_not_fitting():
  peak = lambda b: {"error": "out of memory"} if b > 960 else linear(b)
  r = largest_batch(peak, {32: linear(32), 64: linear(64)}, MEMORY, search=True)
  assert (r["largest"], r["boundary_found"]) == (960, True), r
  assert r["compiled"][961] is None


def test_a_peak_that_is_not_monotonic_gives_a_boundary():
  # XLA's peak wobbles by about a GB from one image to the next (docs/results/aot.md)
  peak = lambda b: {"peak_bytes": linear(b)["peak_bytes"] + (2e9 if b % 7 == 0 else 0)}
  r = largest_batch(peak, {32: linear(32), 64: linear(64)}, MEMORY, search=True)
  b = r["largest"]
  assert r["boundary_found"] and peak(b)["peak_bytes"] <= MEMORY < peak(b + 1)["peak_bytes"]
