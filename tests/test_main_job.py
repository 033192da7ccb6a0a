"""The main job (experiments/train.py on the digits) as a user runs it: mpirun -n 2, and alone."""

import json
import subprocess
import sys

import pytest

from launch import REPO, run_mpi


def read_run(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  config = json.loads((workdir / "config.json").read_text())
  return records, config


@pytest.mark.parametrize("ranks", [2, None], ids=["mpirun-n2", "no-mpirun"])
def test_main_job_reaches_95_percent_test_accuracy(tmp_path, ranks):
  workdir = tmp_path / "run"
  args = ["experiments/train.py", "--workdir", str(workdir), "--no-progress"]
  if ranks is None:  # plain `python experiments/train.py`: a size-1 communicator
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    output = result.stdout + result.stderr
  else:
    result = run_mpi(ranks, args, timeout=600)
    output = result.stdout
  assert result.returncode == 0, output[-10000:]
  records, config = read_run(workdir)
  assert [r["epoch"] for r in records] == list(range(1, config["epochs"] + 1))
  assert config["topology"]["size"] == (ranks or 1) and config["global_batch_size"] == 64
  final = records[-1]
  assert final["test_count"] == 359  # the whole test split, no duplicates
  assert final["test_accuracy"] >= 0.95, final
  assert final["images_per_second"] > 0
  assert "final test accuracy" in output


def test_bad_global_batch_fails_on_every_rank_without_hanging(tmp_path):
  result = run_mpi(
      3, ["experiments/train.py", "--global_batch_size", "64", "--workdir", str(tmp_path)],
      timeout=120,
  )
  assert result.returncode != 0
  assert result.stdout.count("not divisible by the 3 replicas") == 3, result.stdout[-5000:]
