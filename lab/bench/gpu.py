"""A prepared GPU check: is mnjax correct on this machine, and what does it cost? One call.

On a GPU machine (written for one H200 and 16 cores, where the 2 ranks share the GPU through
``create_communicator(..., share_devices=True)``)::

    MNJAX_EXTRAS=cuda scripts/setup.sh && .venv/bin/python -m lab.bench gpu

Estimated 5-7 minutes (not yet run on a GPU), most of it compiling ResNet-50; the whole
run is time-boxed by ``--budget`` (450 s; each mpirun launch gets what is left, at most
``--timeout``, 300 s, and the ResNet launches leave 120 s to the allreduce sweep), so it ends
within 8 minutes. On a CPU, the smoke size CI runs (tests/jobs/test_bench.py; 60-110 s on 2
cores)::

    .venv/bin/python -m lab.bench gpu --smoke

Every launch is ``mpirun -n RANKS`` (``--bind-to core`` on a CPU, ``none`` on GPUs) sharing a
temporary JAX compilation cache; the driver itself never starts JAX (it would hold GPU memory).

It prints a short table, writes every figure to ``--out`` (runs/bench/gpu.json) and exits
with status 1, naming them, if a correctness check failed or a section errored (a failing
section records its error and the run goes on). Sections (keys of the JSON):

* ``environment``: jax, jaxlib, mpi4jax and MPI versions, the platform, and per rank: rank,
  node-local rank, the devices each kind drives (``comm.devices``), the device kind,
  ``MPI4JAX_USE_CUDA_MPI`` (set to 0, copy through host memory, when unset: the mpich wheel
  is not CUDA-aware) and ``mpi4jax_cuda_ext`` (mpi4jax's CUDA handlers loaded; the MPI
  kinds need them on GPUs).
* ``gradients``: per kind (flat, hierarchical, two_dimensional, xla), the digits CNN's
  gradient (`lab.models.SmallCNN`, 151k floats) averaged by `allreduce_gradients` (64 kB
  buckets) inside the kind's step (`data_parallel`), over one global batch, against
  ``flat``'s and against a float64 host reference (each example's gradient in float32 on
  the CPU, summed in float64). ``rel_vs_*`` = max abs difference / max abs reference.
  Passes at <= 1e-5 (float32 summation order: convolutions and matmuls run at full float32
  precision, no TF32) with the result bitwise identical on every rank. Multi-device kinds
  drive 2 emulated devices per process on a CPU, one GPU per process here. ``xla`` runs one
  process per GPU (``processes``): NCCL refuses two ranks of one communicator on one GPU.
* ``collective_order``: each MPI kind's custom calls in one compiled train step, in
  schedule order, whether every rank has the same sequence (a mismatch would deadlock or
  sum unrelated buffers), and ``unchained_pairs``: consecutive calls the later of which does
  not depend on the earlier (`lab.bench.hlo_order`; must be 0); on a CPU also the step
  lowered for CUDA, with its own ``cuda_unchained_pairs``.
* ``resnet_step``: `lab.bench.resnet`'s seconds per step (ResNet-50, 224 px, 32 images per
  rank; smoke: ResNet-6, two blocks, 16 px, 2 images): ``plain`` flax + optax and ``mnjax``
  (SyncBatchNorm + allreduce_gradients) at 1 rank, then at ``--ranks``. ``overhead_size1`` =
  mnjax / plain at 1 rank; ``ranks_over_plain`` = mnjax at N ranks / plain at 1 (ranks that
  share one GPU also share its compute: this measures sharing, not scaling).
* ``allreduce_sweep``: `lab.bench.allreduce` up to 128 MB (smoke: 1 MB): seconds per call
  of each method (the slowest rank's median), the short table's bus bandwidth
  2 (p-1)/p x bytes / time, and its ResNet-50 table (161 leaves; ``--smoke``: at a
  thousandth of the sizes) unless ``--no_allreduce_resnet50``.
  JAX's psum needs NCCL, so it is skipped where ranks share a GPU.
* ``sync_bn_share``: 1 - t(per-rank nn.BatchNorm) / t(SyncBatchNorm), both with
  allreduce_gradients at N ranks: the share of the step SyncBatchNorm's collectives take.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTIONS = ("environment", "gradients", "collective_order", "resnet_step", "allreduce_sweep",
            "sync_bn_share")
TOLERANCE = 1e-5  # relative: max abs difference / max abs reference
ALLREDUCE_RESERVE = 120  # seconds of the budget the ResNet launches leave to the sweep
SIZES = {  # --smoke / GPU defaults
    "smoke": {"resnet": ["--model=resnet6", "--image_size=16", "--batch_per_rank=2",
                         "--steps=1", "--rounds=1"],
              "allreduce": ["--max_bytes=1048576", "--rounds=1", "--seconds=0.001"]},
    "full": {"resnet": ["--model=resnet50", "--image_size=224", "--batch_per_rank=32",
                        "--steps=3", "--rounds=3"],
             "allreduce": ["--max_bytes=134217728", "--rounds=5", "--seconds=0.05"]},
}


def _parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m lab.bench gpu", description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="CI / CPU size (60-110 s on 2 cores)")
  p.add_argument("--ranks", type=int, default=2)
  p.add_argument("--out", default="runs/bench/gpu.json")
  p.add_argument("--timeout", type=float, default=300, help="seconds per mpirun launch")
  p.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
  p.add_argument("--no_allreduce_resnet50", action="store_true",
                 help="skip lab.bench.allreduce's ResNet-50 table")
  p.add_argument("--worker", choices=("mpi", "xla"), help=argparse.SUPPRESS)
  p.add_argument("--global_batch", type=int, default=64, help=argparse.SUPPRESS)
  p.add_argument("--scratch", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.ranks < 2:
    p.error(f"--ranks must be at least 2 (the check compares 1 rank with several),"
            f" got {args.ranks}")
  return args


class _Clock:
  """The run's deadline: each launch gets what is left of ``--budget``, at most
  ``--timeout``; `seconds` records how long each took."""

  def __init__(self, args):
    self.deadline, self.per_launch = time.monotonic() + args.budget, args.timeout
    self.seconds: dict[str, float] = {}

  def run(self, name: str, launch, reserve: float = 0) -> dict:
    """``launch(timeout)``, or ``{"error": ...}`` (the tail of what mpirun printed); the
    timeout leaves `reserve` seconds of the budget to the launches after this one."""
    start = time.monotonic()
    left = self.deadline - start
    timeout = min(self.per_launch, max(left - reserve, 20))
    try:
      if left < 20:  # too little to start JAX on every rank
        raise TimeoutError("skipped: the run's time budget (--budget) is spent")
      return launch(timeout)
    except subprocess.TimeoutExpired as error:
      tail = error.stderr.decode() if isinstance(error.stderr, bytes) else error.stderr or ""
      return {"error": f"TimeoutExpired: the {name} launch ran past {timeout:.0f} s (--timeout,"
                       f" --budget); its stderr ended:\n{tail[-1500:]}"}
    except Exception as error:  # noqa: BLE001 (a failing section is recorded; the run goes on)
      return {"error": f"{type(error).__name__}: {str(error)[-2000:]}"}
    finally:
      self.seconds[name] = round(time.monotonic() - start, 1)


def _layout(ranks: int) -> dict:
  """Where the ranks run, read without starting JAX (this process must hold no GPU)."""
  from mnjax.comm import _devices as devices

  inventory = devices.gpu_inventory()
  gpus = len(inventory) if devices.gpus_expected(inventory) else 0
  shared = gpus > 0 and ranks > gpus
  # NCCL (the xla kind) needs a GPU per process: the most processes dividing `ranks` that fit.
  xla = max(d for d in range(1, gpus + 1) if ranks % d == 0) if shared else ranks
  local = (2 if not gpus else max(1, gpus // ranks)), (2 if not gpus else max(1, gpus // xla))
  batch = 16 * math.lcm(ranks * local[0], xla * local[1])
  return {"gpus": gpus, "shared_gpu": shared, "xla_processes": xla, "global_batch": batch,
          "bind": "none" if gpus else "core"}


def _checks(args, layout: dict, scratch: str, clock: _Clock) -> dict:
  """The two launches of `lab.bench.gpu_worker` -> environment, gradients, order."""
  import numpy as np

  from lab.bench.gpu_worker import GROUPS
  from lab.bench.launch import emulated_devices_env, relaunch

  # emulated multi-device nodes, as lab.bench.kinds
  env = {} if layout["gpus"] else emulated_devices_env(2)
  launches = {group: clock.run(f"checks_{group}", lambda timeout, group=group: relaunch(
      "gpu", ["--worker", group, f"--global_batch={layout['global_batch']}", "--scratch", scratch],
      ranks=args.ranks if group == "mpi" else layout["xla_processes"], bind=layout["bind"],
      env=env, timeout=timeout)) for group in GROUPS}
  mpi = launches["mpi"]
  environment = dict(mpi.get("environment", mpi))
  environment["xla_launch"] = launches["xla"].get("environment", launches["xla"])
  flat = Path(scratch, "flat.npy")
  flat = np.load(flat).astype(np.float64) if flat.exists() else None
  kinds = {}
  for group, launch in launches.items():
    for kind in GROUPS[group]:
      if "error" in launch:
        kinds[kind] = {"error": f"the {group} launch failed (environment shows why)"}
        continue
      grad = np.load(Path(scratch, f"{kind}.npy")).astype(np.float64)
      entry = dict(launch["gradients"][kind])
      entry.update(_errors(grad, np.load(Path(scratch, f"reference_{group}.npy")), "reference"))
      if flat is not None:
        entry.update(_errors(grad, flat, "flat"))
      entry["passed"] = bool(entry["identical_on_all_ranks"]
                             and entry["rel_vs_reference"] <= TOLERANCE
                             and entry.get("rel_vs_flat", 0.0) <= TOLERANCE)
      kinds[kind] = entry
  gradients = {"model": "SmallCNN on digits", "global_batch": layout["global_batch"],
               "tolerance": TOLERANCE, "kinds": kinds}
  order = mpi.get("collective_order", {"error": "the mpi launch failed (environment shows why)"})
  for entry in order.values():
    if isinstance(entry, dict) and "calls" in entry:
      entry["passed"] = bool(entry["same_on_all_ranks"] and entry["calls"]
                             and entry["unchained_pairs"] == 0
                             and entry.get("cuda_unchained_pairs", 0) == 0)
  return {"environment": environment, "gradients": gradients, "collective_order": order}


def _errors(value, reference, name: str) -> dict:
  import numpy as np

  diff = float(np.abs(value - reference).max())
  return {f"max_abs_vs_{name}": diff, f"rel_vs_{name}": diff / float(np.abs(reference).max())}


def _resnet(args, layout: dict, clock: _Clock) -> tuple[dict, dict]:
  """`lab.bench.resnet` at 1 rank and at ``--ranks`` -> resnet_step, sync_bn_share."""
  from lab.bench import resnet

  size = SIZES["smoke" if args.smoke else "full"]["resnet"]
  rargs = resnet.parse_args([*size, f"--bind={layout['bind']}", "--share_devices=1"])
  config = {k: getattr(rargs, k)
            for k in ("model", "image_size", "batch_per_rank", "steps", "rounds")}
  reserve = 0 if args.smoke else ALLREDUCE_RESERVE
  one = clock.run("resnet_1_rank", lambda timeout: resnet.launch(rargs, 1, timeout=timeout),
                  reserve=reserve)
  many = clock.run(f"resnet_{args.ranks}_ranks",
                   lambda timeout: resnet.launch(rargs, args.ranks, timeout=timeout),
                   reserve=reserve)
  if "error" in many:
    return dict(config, one_rank=one, error=many["error"]), {"error": many["error"]}
  share = {"seconds_per_step": {"sync_bn": many["allreduce"],
                                "local_bn": many["allreduce_local_bn"]},
           "share": 1 - many["allreduce_local_bn"] / many["allreduce"]}
  if "error" in one:
    return dict(config, error=one["error"]), share
  summary = resnet.summarize(rargs, one, many)
  step = dict(config, seconds_per_step={"1_rank": one, f"{args.ranks}_ranks": many},
              overhead_size1=summary["overhead_size1"],
              ranks_over_plain=many["allreduce"] / one["plain"],
              communication_share=summary["communication_share"],
              local_bn_efficiency=summary["local_bn_efficiency"],
              double_buffering_efficiency=summary.get("double_buffering_efficiency"),
              weak_scaling_efficiency=summary["weak_scaling_efficiency"])
  return step, share


def _allreduce(args, layout: dict, clock: _Clock) -> dict:
  """`lab.bench.allreduce`'s sweep, then (time allowing) its ResNet-50 table; in a smoke run
  one launch gives both, the table at a thousandth of ResNet-50's sizes (the allreduce
  benchmark's smoke test: `tests/jobs/test_bench.py`)."""
  from lab.bench import allreduce

  common = [f"--ranks={args.ranks}", f"--bind={layout['bind']}", "--share_devices",
            *SIZES["smoke" if args.smoke else "full"]["allreduce"]]
  psum = [] if not layout["shared_gpu"] else ["--no_psum"]
  table = ["--resnet50_fraction=0.001"] if args.smoke else ["--no_resnet50"]
  sweep = clock.run("allreduce_sweep", lambda timeout: allreduce.measure(
      [*common, *psum, *table], timeout=timeout))
  if "error" in sweep:
    return sweep
  result = {"launch": sweep["launch"], "sweep": sweep["mpi"]["sweep"],
            "psum": sweep["psum"]["sweep"] if "psum" in sweep
            else "skipped: NCCL needs one GPU per rank"}
  if args.smoke:
    result["resnet50"] = sweep["mpi"]["resnet50"]
  elif args.no_allreduce_resnet50:
    result["resnet50"] = "skipped (--no_allreduce_resnet50)"
  else:
    result["resnet50"] = clock.run("allreduce_resnet50", lambda timeout: allreduce.measure(
        [*common, "--max_bytes=0", "--no_psum"], timeout=timeout)["mpi"]["resnet50"])
  return result


def _failures(results: dict) -> list[str]:
  """Every error recorded anywhere, and every correctness check that did not pass."""
  found = []

  def walk(node, path):
    if isinstance(node, dict):
      if "error" in node:
        found.append(f"{path}: {node['error'].splitlines()[0][:200]}")
      if node.get("passed") is False:
        found.append(f"{path}: check failed")
      for key, value in node.items():
        walk(value, f"{path}.{key}")

  for section in SECTIONS:
    walk(results.get(section, {"error": "missing"}), section)
  return found


def _table(results: dict) -> None:
  for section in SECTIONS:
    if "error" in results[section]:
      print(f"{section}: ERROR (see the failures below)")
  env = results["environment"]
  print(f"lab.bench gpu: {results['ranks']} ranks, {results['layout']['gpus']} GPU(s),"
        f" {results['wall_seconds']:.0f} s (" + ", ".join(
            f"{k} {v:.0f} s" for k, v in results["launch_seconds"].items()) + ")")
  if "ranks" in env:
    print(f"  jax {env['jax']}, mpi4jax {env['mpi4jax']}, {env['platform']}, {env['mpi_library']}")
    for r in env["ranks"]:
      print(f"  rank {r['rank']} (node rank {r['intra_rank']}): {r['device_kind']},"
            f" flat {r['devices'].get('flat')}, MPI4JAX_USE_CUDA_MPI={r['MPI4JAX_USE_CUDA_MPI']},"
            f" cuda ext {r['mpi4jax_cuda_ext']}")
  grads = results["gradients"]
  print(f"gradients (global batch {grads.get('global_batch')}, pass: rel <= {TOLERANCE:g}):")
  for kind, g in grads.get("kinds", {}).items():
    if "error" in g:
      print(f"  {kind:16s} ERROR")
      continue
    print(f"  {kind:16s} {g['processes']} x {g['local_devices']} devices  rel vs reference"
          f" {g['rel_vs_reference']:.1e}  vs flat {g.get('rel_vs_flat', float('nan')):.1e}"
          f"  same on ranks {g['identical_on_all_ranks']}  {'ok' if g['passed'] else 'FAILED'}")
  print("collective order (MPI calls per compiled step):")
  for kind, o in results["collective_order"].items():
    if isinstance(o, dict) and "calls" in o:
      cuda = o["cuda_lowered"]
      cuda = f"{len(cuda)} calls" if isinstance(cuda, list) else cuda[:60]
      print(f"  {kind:16s} {len(o['calls'])} calls, same on all ranks {o['same_on_all_ranks']};"
            f" unchained pairs {o['unchained_pairs']}; lowered for cuda: {cuda}")
  step, share = results["resnet_step"], results["sync_bn_share"]
  if "overhead_size1" in step:
    seconds = step["seconds_per_step"]
    one, many = seconds["1_rank"], seconds[f"{results['ranks']}_ranks"]
    print(f"resnet step ({step['model']}, {step['image_size']} px, {step['batch_per_rank']}/rank):"
          f" plain {one['plain'] * 1e3:.1f} ms, mnjax {one['mnjax'] * 1e3:.1f} ms"
          f" ({step['overhead_size1']:.3f}x), {results['ranks']} ranks"
          f" {many['allreduce'] * 1e3:.1f} ms ({step['ranks_over_plain']:.3f}x)"
          + (f"; per-rank BN {many['allreduce_local_bn'] * 1e3:.1f} ms, double-buffered"
             f" {many['double_buffering_local_bn'] * 1e3:.1f} ms"
             if "double_buffering_local_bn" in many else ""))
  if "share" in share:
    seconds = share["seconds_per_step"]
    print(f"sync BN share: {share['share']:.3f} (sync {seconds['sync_bn'] * 1e3:.1f} ms,"
          f" per-rank BN {seconds['local_bn'] * 1e3:.1f} ms)")
  sweep = results["allreduce_sweep"]
  if "sweep" in sweep:
    psum = {r["bytes"]: r["seconds"]["jax_psum"] for r in sweep["psum"]} if isinstance(
        sweep["psum"], list) else {}
    print(f"allreduce sweep ({sweep['launch']}), time per call:\n  {'bytes':>11s} {'raw_mpi':>10s}"
          f" {'mpi4jax':>10s} {'mnjax_fp32':>10s} {'jax_psum':>10s} {'mnjax GB/s':>10s}")
    for row in sweep["sweep"]:
      s, n = row["seconds"], row["bytes"]
      cells = [s["raw_mpi"], s["mpi4jax"], s["mnjax_fp32"], psum.get(n)]
      busbw = 2 * (results["ranks"] - 1) / results["ranks"] * n / s["mnjax_fp32"] / 1e9
      print(f"  {n:>11,d} " + " ".join(f"{c * 1e6:8.0f}us" if c else f"{'-':>10s}" for c in cells)
            + f" {busbw:10.3f}")
    if isinstance(sweep["resnet50"], dict) and "mnjax_per_leaf" in sweep["resnet50"]:
      r50 = sweep["resnet50"]
      print("  ResNet-50 gradient: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r50.items()))


def main(argv: list[str]) -> None:
  args = _parse(argv)
  if args.worker:
    from lab.bench import gpu_worker

    result = gpu_worker.run(args.worker, args.global_batch, args.scratch)
    if result is not None:
      print(json.dumps(result), flush=True)
    return
  start, clock = time.monotonic(), _Clock(args)
  layout = _layout(args.ranks)
  results = {"benchmark": "gpu", "smoke": args.smoke, "ranks": args.ranks, "layout": layout}
  with tempfile.TemporaryDirectory(prefix="mnjax-bench-gpu-") as scratch:
    # Every launch inherits these: the ranks compile the same programs as earlier launches
    # (init, plain steps), and the MPI kinds on GPUs need an explicit copy mode.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(scratch, "jax-cache")))
    if layout["gpus"] and "MPI4JAX_USE_CUDA_MPI" not in os.environ:
      os.environ["MPI4JAX_USE_CUDA_MPI"] = "0"
      results["layout"]["MPI4JAX_USE_CUDA_MPI"] = "0 (set by this check: it was unset)"
    results.update(_checks(args, layout, scratch, clock))
    results["resnet_step"], results["sync_bn_share"] = _resnet(args, layout, clock)
    results["allreduce_sweep"] = _allreduce(args, layout, clock)
  results["wall_seconds"] = time.monotonic() - start
  results["launch_seconds"] = clock.seconds
  results["failures"] = failures = _failures(results)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=2))  # first: the table reads it all
  _table(results)
  print(f"results in {args.out}")
  if failures:
    sys.exit("FAILED:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
  main(sys.argv[1:])
