"""The main job (experiments/train.py on the digits) as a user runs it: mpirun -n 2, and alone;
its TensorBoard scalars and a jax.profiler trace of two steps come with it."""

import json
import subprocess
import sys

import pytest
from support.events import read_scalars
from support.launch import REPO, run_mpi, xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


def read_run(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  config = json.loads((workdir / "config.json").read_text())
  return records, config


@pytest.mark.parametrize("ranks", [2, None], ids=["mpirun-n2", "no-mpirun"])
def test_main_job_reaches_95_percent_test_accuracy(tmp_path, ranks):
  workdir = tmp_path / "run"
  args = ["experiments/train.py", "--workdir", str(workdir), "--no-progress",
          "--profile_steps", "2:4"]
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
  # TensorBoard (--tensorboard auto): rank 0's scalars are the records, at their steps.
  scalars = read_scalars(workdir / "tensorboard")
  steps = [r["steps"] for r in records]
  for tag, key in [("train/loss", "train_loss"), ("test/accuracy", "test_accuracy"),
                   ("throughput/images_per_second", "images_per_second"),
                   ("optimizer/learning_rate", "learning_rate"),
                   ("optimizer/skipped_steps", "skipped_steps")]:
    assert [s for s, _ in scalars[tag]] == steps, tag
    assert [v for _, v in scalars[tag]] == pytest.approx([r[key] for r in records], rel=1e-6)
  assert final["learning_rate"] == config["learning_rate"]
  # --profile_steps 2:4: one jax.profiler trace per rank, of global steps 2 and 3.
  for rank in range(ranks or 1):
    (trace,) = (workdir / "profile" / f"rank{rank}" / "plugins" / "profile").iterdir()
    assert list(trace.glob("*.xplane.pb")), sorted(trace.iterdir())
  assert "jax.profiler trace of global steps 2 .. 3" in output


def test_bad_global_batch_fails_on_every_rank_without_hanging(tmp_path):
  result = run_mpi(
      3, ["experiments/train.py", "--global_batch_size", "64", "--workdir", str(tmp_path)],
      timeout=120,
  )
  assert result.returncode != 0
  assert result.stdout.count("not divisible by the 3 replicas") == 3, result.stdout[-5000:]


def test_flat_4_processes_hierarchical_and_xla_2x2_train_the_same_parameters(tmp_path):
  """The same global batches, split 4 x 1 or 2 x 2, give the same parameters (to 1e-5);
  `xla` runs jax.distributed with gloo collectives under mpirun."""
  import numpy as np

  runs = {"flat": 4, "hierarchical": 2, "xla": 2}
  for kind, ranks in runs.items():
    result = run_mpi(
        ranks,
        ["experiments/train.py", "--comm", kind, "--epochs", "1", "--no-progress",
         "--workdir", str(tmp_path / kind)],
        timeout=600, env={"XLA_FLAGS": xla_flags(2)},
    )
    assert result.returncode == 0, result.stdout[-5000:]
  flat = np.load(tmp_path / "flat" / "params.npz")
  assert len(flat) == 8
  for kind in ("hierarchical", "xla"):
    other = np.load(tmp_path / kind / "params.npz")
    assert sorted(other) == sorted(flat)
    for key in flat:
      assert np.linalg.norm(flat[key] - other[key]) <= 1e-5 * np.linalg.norm(flat[key]), (kind, key)
  configs = [read_run(tmp_path / kind)[1]["topology"] for kind in runs]
  assert [(c["size"], c["local_device_count"]) for c in configs] == [(4, 1), (2, 2), (2, 2)]
