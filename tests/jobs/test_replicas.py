"""The main job with a fixed replica count (experiments/train.py --replicas 12): the same
final parameters and the same logged metrics, bit for bit, at 1, 2 and 4 processes, and a
run saved at 2 processes in the middle of an epoch, resumed at 3 and then at 6, equals the
uninterrupted run at 1 bit for bit; a resume with another replica count is refused.

Each launch trains the digits CNN over 12 replicas (12 / P emulated CPU devices per
process) with a global batch of 96; the parameters are compared by their digest, the
metrics as the floats metrics.jsonl holds. Without --replicas the same launches give a
different digest at each process count (docs/results/replicas.md), which is what makes
these equalities a test. Every launch compiles alike (`support.launch.COMPILE_FAST`).
"""

import hashlib
import json
import shutil

import numpy as np
import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

ARGS = ["experiments/train.py", "--replicas", "12", "--global_batch_size", "96",
        "--no-progress", "--stall_timeout", "0"]


def train(workdir, processes, epochs, *more):
  result = run_mpi(processes, [*ARGS, "--workdir", str(workdir), "--epochs", str(epochs),
                               *more], timeout=600)
  assert result.returncode == 0, result.stdout[-10000:]
  assert "12 replicas, exact sums" in result.stdout
  return digest(workdir)


def digest(workdir):
  params = np.load(workdir / "params.npz")
  return hashlib.sha256(b"".join(params[k].tobytes() for k in sorted(params.files))).hexdigest()


def metrics(workdir):
  """Each epoch's logged train and test figures (not its timings)."""
  keys = ("epoch", "steps", "train_loss", "train_accuracy", "test_loss", "test_accuracy",
          "test_count")
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: r[k] for k in keys} for r in records]


def test_the_same_bits_at_any_number_of_processes_and_across_resumes(tmp_path):
  # 15 steps per epoch; checkpoints at steps 4, 8 and 12 as well as at the epoch's end.
  counts = (1, 2, 4)
  one_epoch = {p: train(tmp_path / f"p{p}", p, 1, "--checkpoint_steps", "4") for p in counts}
  assert len(set(one_epoch.values())) == 1, one_epoch
  logged = [metrics(tmp_path / f"p{p}") for p in counts]
  assert all(m == logged[0] for m in logged), logged
  # A resume with another replica count: refused on every rank, naming both counts.
  result = run_mpi(2, [*ARGS[:2], "6", *ARGS[3:], "--workdir", str(tmp_path / "p1"),
                       "--epochs", "2", "--resume"], timeout=300)
  assert result.returncode != 0
  assert "replicas" in result.stdout and "12" in result.stdout, result.stdout[-5000:]
  # Saved at 2 processes after step 8 of epoch 1 (its later checkpoints removed, as if the
  # job had been killed there: the checkpoint holds every replica's partial metric sums),
  # resumed at 3 (to the end of epoch 2), then at 6 (epoch 3). The uninterrupted run is the
  # cheapest launch, one process holding the 12 replicas.
  chain = tmp_path / "chain"
  shutil.copytree(tmp_path / "p2", chain)
  later = [d for d in (chain / "checkpoints").iterdir() if d.name.isdigit() and int(d.name) > 8]
  assert len(later) == 2, sorted(d.name for d in (chain / "checkpoints").iterdir())
  for d in later:
    shutil.rmtree(d)
  train(chain, 3, 2, "--resume")
  resumed = train(chain, 6, 3, "--resume")
  uninterrupted = train(tmp_path / "whole", 1, 3)
  assert resumed == uninterrupted
  assert metrics(chain) == metrics(tmp_path / "whole")
  assert [r["epoch"] for r in metrics(chain)] == [1, 2, 3]

