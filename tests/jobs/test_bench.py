"""The benchmark runs end to end and reports every figure (its numbers are not asserted:
speed goals are judged by running `python -m lab.bench step`, not by timed tests)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch import REPO

from lab.bench.allreduce import SWEEP
from lab.bench.gpu import SECTIONS

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


def run_bench(name, args, tmp_path):
  """Runs `python -m lab.bench <name> <args> --out ...`; returns (stdout, JSON results)."""
  out = tmp_path / f"{name}.json"
  result = subprocess.run(
      [sys.executable, "-m", "lab.bench", name, *args, "--out", str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=600,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout, json.loads(out.read_text())


def test_step_benchmark_smoke(tmp_path):
  stdout, data = run_bench("step", ["--rounds", "1", "--steps", "2", "--timeline",
                                    str(tmp_path / "step_timeline.json")], tmp_path)
  assert set(data["size1"]["seconds_per_step"]) == {"plain_optax", "mnjax_size1"}
  assert data["multi"]["ranks"] == 2
  assert set(data["multi"]["images_per_second"]) == {
      "no_communication", "allreduce", "allreduce_bf16_wire", "allreduce_buckets_64kB",
      "allreduce_leaving_early", "allreduce_double_buffering", "allreduce_timeline",
      "naive_mpi4jax", "allreduce_exact"}
  assert all(v > 0 for v in data["multi"]["images_per_second"].values())
  # The timeline variant's cost, and its trace: valid JSON holding the variant's collectives.
  assert data["multi"]["timeline_overhead"] > 0 and data["multi"]["exact_overhead"] > 0
  events = json.loads(Path(data["multi"]["timeline"]).read_text())["traceEvents"]
  assert any(e.get("ph") == "X" and e.get("args", {}).get("op") == "bucket allreduce"
             and e["args"]["bytes"] > 0 for e in events)
  assert "efficiency" in stdout


def test_unknown_benchmark_is_a_clear_error():
  result = subprocess.run([sys.executable, "-m", "lab.bench", "nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  usage = ("usage: python -m lab.bench {allreduce, step, kinds, resnet, checks, scaling, gpu,"
           " zero, aot, cluster}")
  assert result.returncode != 0 and usage in result.stderr


def test_zero_benchmark_smoke(tmp_path):
  """At 2 ranks each rank holds adam's step count (int32) and the two float32 moments of
  ceil(n / 2) elements of every leaf of n; unsharded, of all n."""
  import math

  import jax
  import jax.numpy as jnp

  from lab.bench.launch import resnet50_shapes
  from lab.models import SmallCNN

  stdout, data = run_bench("zero", ["--ranks", "2", "--smoke"], tmp_path)
  (row,) = data["rows"]
  assert row["ranks"] == 2 and row["bound"]
  cnn = jax.eval_shape(lambda: SmallCNN().init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
  leaves = {"digits_cnn": [x.size for x in jax.tree.leaves(cnn["params"])],
            "resnet50_update": [math.prod(s) for s in resnet50_shapes()[:12]]}
  for workload, sizes in leaves.items():
    w = row[workload]
    assert w["params"] == sum(sizes)
    assert w["state_bytes_per_rank"] == {
        "unsharded": 4 + 8 * sum(sizes), "sharded": 4 + 8 * sum(-(-n // 2) for n in sizes)}
    assert all(len(b) == 2 and len(set(b)) == 1 for b in w["state_bytes_each_rank"].values())
    assert w["state_ratio"] == pytest.approx(0.5, abs=1e-3)
    sec = w["seconds_per_step"]
    assert min(sec.values()) > 0 and w["time_ratio"] == sec["sharded"] / sec["unsharded"]
  assert row["digits_cnn"]["params"] == 151_306 and row["resnet50_update"]["leaves"] == 12
  assert "optimizer update step only" in stdout and "ms/step" in stdout


def test_kinds_benchmark_smoke(tmp_path):
  _, data = run_bench("kinds", ["--rounds", "1", "--steps", "2", "--big_calls", "1"], tmp_path)
  assert (data["mpi"]["processes"], data["mpi"]["devices_per_process"]) == (2, 2)
  assert set(data["mpi"]["reduce_us"]) == {"local_only", "hierarchical", "two_dimensional"}
  assert set(data["xla"]["reduce_us"]) == {"local_only", "xla"}
  assert all(v > 0 for group in data.values() for v in group["step_ms"].values())


def test_checks_benchmark_smoke(tmp_path):
  stdout, data = run_bench("checks", ["--rounds", "1", "--steps", "2"], tmp_path)
  assert data["ranks"] == 2
  assert set(data["overhead"]) == {"skip_nonfinite", "default_checks", "watchdog_100x"}
  assert all(v > 0 for v in data["seconds_per_step"].values())
  assert data["check_replicas_seconds"] > 0
  assert "default_checks" in stdout and "check_replicas" in stdout


def test_scaling_benchmark_smoke(tmp_path):
  stdout, data = run_bench("scaling", ["--ranks", "1", "2", "--rounds", "1", "--steps", "2"],
                           tmp_path)
  assert [r["ranks"] for r in data["rows"]] == [1, 2]
  assert data["params"] == 151_306  # the digits CNN
  two = data["rows"][1]
  assert two["seconds_allreduce"] > 0 and two["seconds_no_communication"] > 0
  assert (two["communication_efficiency"]
          == two["seconds_no_communication"] / two["seconds_allreduce"])
  assert "weak scaling" in stdout


def test_gpu_check_smoke(tmp_path):
  """The prepared GPU check, at smoke size on the CPU: every section, and its deterministic
  checks pass (each kind's averaged gradient matches flat's and the float64 reference, and
  every rank compiles the same MPI call sequence). Its ResNet section runs the ResNet
  benchmark (`lab.bench.resnet`) at 1 and 2 ranks, and its allreduce section the allreduce
  benchmark (`lab.bench.allreduce`: every MPI method, JAX's psum, the ResNet-50 table at a
  thousandth of its sizes): those benchmarks' smoke tests."""
  stdout, data = run_bench("gpu", ["--smoke"], tmp_path)
  assert data["failures"] == []
  for section in SECTIONS:
    assert section in data and "error" not in data[section], section
  assert [r["rank"] for r in data["environment"]["ranks"]] == [0, 1]
  kinds = data["gradients"]["kinds"]
  assert set(kinds) == {"flat", "hierarchical", "two_dimensional", "xla"}
  for kind, check in kinds.items():
    assert check["passed"] and check["identical_on_all_ranks"], (kind, check)
    assert check["rel_vs_reference"] <= 1e-5 and check["rel_vs_flat"] <= 1e-5, (kind, check)
  order = data["collective_order"]
  assert set(order) == {"flat", "hierarchical", "two_dimensional"}
  assert all(o["same_on_all_ranks"] and o["calls"] and o["unchained_pairs"] == 0
             for o in order.values())
  # lab.bench.resnet at 1 and 2 ranks (its smoke size): every variant and figure.
  resnet = data["resnet_step"]
  assert set(resnet["seconds_per_step"]["1_rank"]) == {"plain", "mnjax"}
  assert set(resnet["seconds_per_step"]["2_ranks"]) == {
      "allreduce", "allreduce_local_bn", "double_buffering_local_bn", "no_communication"}
  assert all(v > 0 for row in resnet["seconds_per_step"].values() for v in row.values())
  assert all(resnet[key] > 0 for key in ("overhead_size1", "weak_scaling_efficiency",
                                         "double_buffering_efficiency"))
  assert set(data["sync_bn_share"]["seconds_per_step"]) == {"sync_bn", "local_bn"}
  sweep = data["allreduce_sweep"]
  assert [row["bytes"] for row in sweep["sweep"]][-1] == 1 << 20
  assert all(set(row["seconds"]) == set(SWEEP) for row in sweep["sweep"])
  assert len(sweep["resnet50"]) == 15 and all(v > 0 for v in sweep["resnet50"].values())
  # lab.bench.allreduce's psum launch (jax.distributed + gloo), the same sizes as MPI's.
  assert ([row["bytes"] for row in data["allreduce_sweep"]["psum"]]
          == [row["bytes"] for row in data["allreduce_sweep"]["sweep"]])
  assert all(row["seconds"]["jax_psum"] > 0 for row in data["allreduce_sweep"]["psum"])
  assert "gradients" in stdout and "sync BN share" in stdout
