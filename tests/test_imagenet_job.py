"""experiments/imagenet.py: a short ResNet-18 run on mocked CIFAR-10 under mpirun -n 2."""

import json
import re

from launch import run_mpi


def test_resnet18_on_mock_cifar10_two_ranks_learns_and_keeps_replicas_identical(tmp_path):
  workdir = tmp_path / "run"
  result = run_mpi(2, [
      "tests/imagenet_job_mocked.py", "--config", "cifar10", "--epochs", "4",
      "--global_batch_size", "8", "--base_lr", "0.32", "--warmup_epochs", "0",
      "--workdir", str(workdir), "--checkpoint_every", "2",
  ], timeout=600, env={"MNJAX_MOCK_EXAMPLES": "32"})
  assert result.returncode == 0, result.stdout[-8000:]
  digests = dict(re.findall(r"DIGEST rank (\d) ([0-9a-f]{64})", result.stdout))
  assert set(digests) == {"0", "1"}, result.stdout[-4000:]
  # Parameters and BN statistics are bitwise the same on both ranks.
  assert digests["0"] == digests["1"]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["epoch"] for r in records] == [1, 2, 3, 4]
  assert records[-1]["train_loss"] < records[0]["train_loss"]
  assert records[-1]["steps"] == 4 * (32 // 8)  # every rank ran every step
  assert all(r["test_count"] == 32 for r in records)  # every test example once, over 2 ranks
  assert all(r["images_per_second"] > 0 and 0 <= r["input_wait_share"] <= 1 for r in records)
  config = json.loads((workdir / "config.json").read_text())
  assert config["topology"]["size"] == 2 and config["sync_bn"] is True
  assert sorted(p.name for p in workdir.glob("checkpoint_*.npz")) == [
      "checkpoint_2.npz", "checkpoint_4.npz"]
