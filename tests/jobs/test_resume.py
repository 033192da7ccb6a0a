"""Kill the main job mid-way (SIGKILL of rank 1), resume it with --resume: it ends with
parameters bitwise equal to a run that was never interrupted (mpirun -n 2)."""

import json
import re
import shutil

import numpy as np
import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

FLAGS = ["--epochs", "2", "--checkpoint_steps", "5", "--no-progress"]
STEPS_PER_EPOCH = 22
KILL_STEP = 31  # of 44: mid-way through epoch 2, between two checkpoints


def records(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
  # The optimizer states that hold more than replicated values resume mid-epoch bitwise in
  # cheaper tests: double buffering's pending gradient in the loop
  # (tests/distributed/test_double_buffering.py), ZeRO-1's shares in the sharded job below.
  flags = FLAGS
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  result = run_mpi(2, ["experiments/train.py", *flags, "--workdir", str(whole)], timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]

  result = run_mpi(2, ["tests/support/killed_train.py", "1", str(KILL_STEP), *flags,
                       "--workdir", str(killed)], timeout=300)
  assert result.returncode != 0 and "final test accuracy" not in result.stdout
  assert not (killed / "params.npz").exists()

  result = run_mpi(2, ["experiments/train.py", *flags, "--workdir", str(killed), "--resume"],
                   timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  # The newest complete checkpoint before the kill: step 30, or an earlier one if rank 0
  # was still writing when the job went down (a loaded machine writes slowly).
  found = re.search(r"resuming at epoch (\d+), batch (\d+) \(step (\d+)\)", result.stdout)
  assert found, result.stdout[-3000:]
  epoch, batch, step = map(int, found.groups())
  assert step in (5, 10, 15, 20, 22, 25, 30) and batch == step - STEPS_PER_EPOCH * (epoch - 1)

  a, b = np.load(whole / "params.npz"), np.load(killed / "params.npz")
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)  # bitwise
  # Epoch 2's training metrics come back whole (the partial sums are checkpointed too;
  # summed in another order, the loss may differ in the last float32 bits).
  for epoch in (2,):
    (x,), (y,) = ([r for r in records(d) if r["epoch"] == epoch] for d in (whole, killed))
    for key in ("train_accuracy", "test_loss", "test_accuracy", "steps"):
      assert x[key] == y[key], (epoch, key)
    np.testing.assert_allclose(x["train_loss"], y["train_loss"], rtol=1e-6)


def test_a_fresh_run_does_not_overwrite_checkpoints(tmp_path):
  args = ["experiments/train.py", "--epochs", "1", "--no-progress", "--workdir", str(tmp_path)]
  assert run_mpi(2, args, timeout=300).returncode == 0
  before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  result = run_mpi(2, args, timeout=300)
  assert result.returncode != 0
  assert result.stdout.count("already holds checkpoints (steps [22]). Pass --resume") == 2
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_a_sharded_run_saved_on_3_processes_resumes_on_2_bit_for_bit(tmp_path):
  # ZeRO-1 checkpoints hold the whole optimizer state, so the run goes on with another
  # number of processes; over a fixed replica count (exact sums, each process's share of
  # the exact mean) it ends with the bits of the run that was never moved. The moved run is
  # that run's work directory as it was after step 10 (its later checkpoints removed, as if
  # killed there).
  flags = ["--no-progress", "--global_batch_size", "48", "--shard_optimizer", "--replicas", "6",
           "--epochs", "1", "--checkpoint_steps", "10"]
  whole, moved = tmp_path / "whole", tmp_path / "moved"
  result = run_mpi(3, ["experiments/train.py", *flags, "--workdir", str(whole)], timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  shutil.copytree(whole, moved)
  later = [d for d in (moved / "checkpoints").iterdir() if d.name.isdigit() and int(d.name) > 10]
  assert later, sorted(d.name for d in (moved / "checkpoints").iterdir())
  for d in later:
    shutil.rmtree(d)
  (moved / "params.npz").unlink()
  result = run_mpi(2, ["experiments/train.py", *flags, "--workdir", str(moved), "--resume"],
                   timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  assert "2 rank(s)" in result.stdout and "resuming at epoch 1, batch 10" in result.stdout
  a, b = np.load(whole / "params.npz"), np.load(moved / "params.npz")
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)  # bitwise
  (x,), (y,) = records(whole), records(moved)
  for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "steps"):
    assert x[key] == y[key], key
