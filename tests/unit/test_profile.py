"""`lab.runner.StepProfiler` and `profile_window`: which steps ``--profile_steps`` traces
(a count from the run's second step, a global ``A:B`` range), one trace per window."""

import jax
import jax.numpy as jnp
import pytest

from lab.runner import StepProfiler, profile_window


@pytest.mark.parametrize("spec, first_step, window", [
    ("3", 0, (1, 4)), ("2", 40, (41, 43)), (" 10:13 ", 40, (10, 13)), ("", 5, None)])
def test_the_window_of_a_count_starts_after_the_runs_first_step(spec, first_step, window):
  assert profile_window(spec, first_step) == window


@pytest.mark.parametrize("spec", ["0", "4:4", "5:2", "-1", "1:", "a", "1.5"])
def test_a_bad_window_says_what_is_allowed(spec):
  with pytest.raises(ValueError, match=f"--profile_steps must be N .* got {spec!r}"):
    profile_window(spec)


def test_the_steps_of_the_window_are_traced_once_and_nothing_outside_it(comm, tmp_path):
  f, x = jax.jit(lambda x: x + 1), jnp.zeros(2)
  for window, traced in [((2, 4), [2, 3]), ((9, 12), [])]:
    directory = tmp_path / str(window[0])
    with StepProfiler(window, directory, comm) as profiler:
      for step in range(6):
        with profiler.before(step):
          x = f(x)
        profiler.after(step + 1, x)
      assert profiler.steps == traced
    runs = directory / f"rank{comm.rank}" / "plugins" / "profile"
    assert len(list(runs.iterdir())) == 1 if traced else not directory.exists()
