"""experiments/imagenet.py: a short ResNet-6 run (the CIFAR-10 config, two residual blocks) on
mocked CIFAR-10 under mpirun -n 2, and the same run stopped and resumed mid-epoch."""

import json
import re
import shutil

import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

FLAGS = ["tests/support/imagenet_job_mocked.py", "--config", "resnet18_cifar10",
         "--model", "resnet6", "--global_batch_size", "8", "--base_lr", "0.32",
         "--warmup_epochs", "0"]


def run(workdir, *flags):
  result = run_mpi(2, [*FLAGS, "--workdir", str(workdir), *flags], timeout=600,
                   env={"MNJAX_MOCK_EXAMPLES": "32"})
  assert result.returncode == 0, result.stdout[-8000:]
  digests = dict(re.findall(r"DIGEST rank (\d) ([0-9a-f]{64})", result.stdout))
  assert set(digests) == {"0", "1"}, result.stdout[-4000:]
  # Parameters and BN statistics are bitwise the same on both ranks.
  assert digests["0"] == digests["1"]
  return result.stdout, digests["0"]


def test_resnet_on_mock_cifar10_two_ranks_learns_keeps_replicas_identical_and_resumes(tmp_path):
  workdir = tmp_path / "run"
  _, whole = run(workdir, "--epochs", "4", "--checkpoint_every", "2")
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["epoch"] for r in records] == [1, 2, 3, 4]
  assert records[-1]["train_loss"] < records[0]["train_loss"]
  assert records[-1]["steps"] == 4 * (32 // 8)  # every rank ran every step
  assert all(r["test_count"] == 32 for r in records)  # every test example once, over 2 ranks
  assert all(r["images_per_second"] > 0 and 0 <= r["input_wait_share"] <= 1 for r in records)
  assert all(r["skipped_steps"] == 0 for r in records)
  config = json.loads((workdir / "config.json").read_text())
  assert config["topology"]["size"] == 2 and config["sync_bn"] is True
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [8, 16]

  # Two epochs with a checkpoint every 3 steps (3, 6 and the epoch end, 8); drop the newest
  # so that the run resumes mid-epoch (epoch 2, batch 2), then run to 4 epochs.
  part = tmp_path / "part"
  run(part, "--epochs", "2", "--checkpoint_steps", "3")
  shutil.rmtree(part / "checkpoints" / "8")
  out, resumed = run(part, "--epochs", "4", "--checkpoint_steps", "3", "--resume")
  assert "resuming at epoch 2, batch 2 (step 6)" in out
  assert resumed == whole  # bitwise: parameters, BN statistics
