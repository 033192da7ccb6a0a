"""Kill a process while it saves a checkpoint, at several points: the restore never loads a
partial save, and it returns the newest complete one (tests/support/save_forever.py)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from support.launch import REPO

import mnjax

pytestmark = pytest.mark.slow

SHAPE = (3, 1 << 24)  # as in tests/support/save_forever.py

# Where saving step 3 dies, and the step a restore must then return.
POINTS = {"host_copy": 2, "commit": 2, "before_rename": 2, "after_rename": 3}


def kill_while_saving(directory: Path, point: str | None = None, delay: float = 0.0):
  """Runs save_forever.py until it dies at `point` of saving step 3, or until it is
  SIGKILLed `delay` s after it starts saving step 3. Returns its output lines, split."""
  proc = subprocess.Popen(
      [sys.executable, "tests/support/save_forever.py", str(directory),
       *([point] if point else [])],
      cwd=REPO, stdout=subprocess.PIPE, text=True)
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line.split())
      if point is None and lines[-1] == ["saving", "3"]:
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        break
    lines.extend(line.split() for line in proc.stdout)
  finally:
    proc.kill()
    proc.wait(timeout=60)
  return lines


def restore(directory: Path, comm):
  with mnjax.Checkpointer(directory, comm) as ckpt:
    step, state, _ = ckpt.restore({"a": jnp.zeros(SHAPE), "step": 0})
    return step, state, ckpt.steps()


def check(directory: Path, comm, expected: int) -> None:
  # A save cut short leaves only orbax's temporary directory, which is never listed.
  leftovers = [p.name for p in directory.iterdir() if not p.name.isdigit()]
  assert all("orbax-checkpoint-tmp" in name for name in leftovers), leftovers
  step, state, complete = restore(directory, comm)
  assert step == expected == max(complete)
  assert state["step"] == step
  assert float(state["a"].min()) == float(state["a"].max()) == float(step)


@pytest.mark.parametrize("point", sorted(POINTS))
def test_killed_at_a_point_of_the_save(comm, tmp_path, point):
  lines = kill_while_saving(tmp_path, point)
  assert lines[-2:] == [["saving", "3"], ["killed", "at", point]]  # the hook fired
  if POINTS[point] == 2:  # the half-written step is on disk, unlisted
    assert any("orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir()) or point == "host_copy"
  check(tmp_path, comm, POINTS[point])


@pytest.mark.parametrize("delay", [0.2, 0.45])
def test_killed_at_a_random_moment_of_the_save(comm, tmp_path, delay):
  lines = kill_while_saving(tmp_path, delay=delay)
  saved = [int(n) for verb, n in lines if verb == "saved"]
  step, _, _ = restore(tmp_path, comm)
  assert step in (max(saved), max(saved) + 1)  # the last reported, or one that just made it
  check(tmp_path, comm, step)
