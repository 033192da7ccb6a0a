"""The experiments' ResNet-50 step compiled for H200 nodes without a GPU: what the schedule shows.

    .venv-cuda/bin/python -m lab.bench aot            # ResNet-50, 8 and 4x8 H200 (~50 min here)
    .venv-cuda/bin/python -m lab.bench aot --quick    # a 2-block ResNet, 16 px, 2 H200 (tests)

Needs JAX's CUDA plugin, in a venv of its own (``MNJAX_EXTRAS=cuda MNJAX_VENV=.venv-cuda
scripts/setup.sh``; no GPU, driver or toolkit); without it the bench says so in one line. It
sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` itself. Each step is built as
``experiments/imagenet.py`` builds it (ResNet-50, 224 px, label smoothing 0.1,
``lab.runner.guarded_optimizer`` around Goyal et al.'s momentum SGD, `mnjax.SyncBatchNorm`
or per-rank ``nn.BatchNorm``) and compiled with `lab.aot` (``lab/aot/targets/h200.txtpb``;
what differs from a real run: `lab.aot.train_step`). From the compiled, scheduled HLO
(`lab.aot.schedule`) it prints, per variant:

* **overlap**: each async collective's kernels between start and done, and the share of the
  gradient bytes whose all-reduce has compute beside it; the collectives that are not
  gradients and have nothing beside them (BatchNorm statistics on the critical path);
* **combining**: the gradient all-reduces XLA left and their sizes, against mnjax's bucket
  plan (4 MiB on GPUs, `mnjax.comm.default_bucket_bytes`) and with XLA's combiner threshold
  (``xla_gpu_all_reduce_combine_threshold_bytes``) lowered to the bucket size;
* **memory** per GPU (``flat``, the kind `shard_optimizer` runs on): parameters, optimizer
  state and temporaries for 32, 128 and 256 images per GPU with ``allreduce_gradients`` + adam
  and with ``shard_optimizer(adam)``, and the largest batch whose step fits in
  ``--memory_fraction`` of the GPU's memory (JAX's default allocator share, 0.75): an affine
  fit, then compiled around it (`lab.bench.aot_memory`; a second process with ``--jobs 2``);
* **order**: the collectives of every process's program in order (``xla``: one SPMD program
  for all, compared between the first and last rank's lowering; ``flat`` with
  ``shard_optimizer``, whose program depends on the rank, compiled for both);
* **MPI kinds**: ``flat``, ``hierarchical``, ``two_dimensional`` compiled with mpi4jax's CUDA
  custom calls (synchronous: nothing overlaps them), or the compiler's error;
* plain ``jax.jit`` data parallelism (flax ``nn.BatchNorm`` on the global batch, the same
  optimizer, the batch sharded over the mesh), side by side;
* compute time per step from the compiled cost (`lab.costmodel.compiled`).

JSON goes to ``--out`` (runs/bench/aot.json); the last line is ``aot summary: ...`` for
ResNet-50 on 8 H200: ``overlap_backprop`` (SyncBatchNorm + allreduce_gradients, the
experiments' default, xla kind), ``overlap_double_buffering`` (the same with double buffering),
``overlap_plain_jax``, ``zero1_state_ratio`` (shard_optimizer's optimizer state per GPU over
allreduce + adam's, from memory_analysis, flat kind: shard_optimizer refuses xla) and
``max_batch_allreduce`` / ``max_batch_shard`` (flat kind).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

SIZES = {
    "full": {"model": "resnet50", "image": 224, "stem": "imagenet", "classes": 1000,
             "batch": 32, "memory_batches": (32, 128, 256), "targets": ("8xH200", "4x8xH200"),
             "mpi_target": "2x4xH200", "search": True},
    "quick": {"model": "tiny", "image": 16, "stem": "cifar", "classes": 10, "batch": 8,
              "memory_batches": (8, 16), "targets": ("2xH200",), "mpi_target": "2x2xH200",
              "search": False},
}
IMAGENET_TRAIN = 1_281_167
#: Variants compiled on every target (the others on the first only).
EVERY_TARGET = ("sync_bn_allreduce_fp32", "sync_bn_double_buffering_fp32", "plain_jax")


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m lab.bench aot", description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="a 2-block ResNet, 16 px, 2 H200 (tests)")
  p.add_argument("--targets", nargs="+", help="e.g. 8xH200 4x8xH200 (default: by size)")
  p.add_argument("--memory_fraction", type=float, default=0.75,
                 help="share of the GPU's memory a step may use (JAX preallocates 0.75)")
  p.add_argument("--out", default="runs/bench/aot.json")
  p.add_argument("--save_hlo", default="", help="a folder: write each compiled program there")
  p.add_argument("--jobs", type=int, default=2,
                 help="2: the memory section compiles in a second process, beside the rest")
  args = p.parse_args(argv)
  if not 0 < args.memory_fraction <= 1:
    p.error(f"--memory_fraction must be in (0, 1], got {args.memory_fraction}")
  return args


def _config(global_batch: int, **flags):
  from lab.runner import RunConfig

  return RunConfig(epochs=1, global_batch_size=global_batch, workdir="runs/aot", **flags)


def _model(size, comm, sync_bn: bool):
  """The config's ResNet, with `mnjax.SyncBatchNorm` (or nn.BatchNorm: per rank under mnjax,
  over the global batch under plain jax.jit)."""
  import flax.linen as nn

  import mnjax
  from lab import models

  cls = {"resnet50": models.ResNet50, "tiny": models.ResNet6}  # --quick: two blocks, for tests
  norm = functools.partial(mnjax.SyncBatchNorm, comm) if sync_bn else nn.BatchNorm
  return cls[size["model"]](num_classes=size["classes"], stem=size["stem"], norm=norm,
                            bn_momentum=0.9)


def _optimizer(size, comm, global_batch: int, *, adam: bool = False, **flags):
  """The experiments' chain (`lab.runner.guarded_optimizer`) around Goyal et al.'s SGD, or
  adam (the memory comparison)."""
  import optax

  from mnjax.optim import recipes

  inner = (optax.adam(1e-3) if adam else
           recipes.goyal_sgd(global_batch, max(1, IMAGENET_TRAIN // global_batch)))
  from lab.runner import guarded_optimizer

  return guarded_optimizer(inner, comm, _config(global_batch, **flags))


def _variant(name: str) -> dict:
  """``sync_bn_allreduce_fp32`` -> the experiment flags it stands for."""
  parts = name.split("_")
  return {"sync_bn": parts[0] == "sync", "double_buffering": "double" in parts,
          "wire_dtype": "bfloat16" if parts[-1] == "bf16" else "float32"}


def _analyse(compiled, step, args, gpu: str, mpi: bool = False) -> dict:
  from lab import aot
  from lab.costmodel import compiled as cost

  s = aot.schedule(compiled.text, aot.parameter_outputs(step, args))
  grads = [c for c in s.gradients if not mpi or "mpi" in c.kind]
  first = min((c.position for c in grads), default=None)
  t = cost.compute_time(compiled.flops, compiled.bytes_accessed, gpu)
  return {
      "compile_seconds": round(compiled.seconds, 1), "memory": compiled.memory,
      "peak_bytes": compiled.peak_bytes, "flops": compiled.flops,
      "bytes_accessed": compiled.bytes_accessed,
      "compute_seconds": {"flops_bound": t.flops_seconds, "bytes_bound": t.bytes_seconds,
                          "bound": t.bound},
      "overlap": s.overlap(mpi=mpi),
      "overlap_beside_convolutions": (sum(c.gradient_bytes for c in grads if c.heavy_inside)
                                      / max(1, sum(c.gradient_bytes for c in grads))),
      "gradient_allreduces": [{"kind": c.kind, "bytes": c.payload_bytes,
                               "gradient_bytes": c.gradient_bytes, "async": c.asynchronous,
                               "compute_inside": c.compute_inside, "heavy_inside": c.heavy_inside,
                               "depends_on_compute": c.depends_on_heavy} for c in grads],
      "other_collectives": len(s.collectives) - len(grads),
      "critical": {"count": len(s.critical()),
                   "bytes": sum(c.payload_bytes for c in s.critical())},
      "first_gradient_before_last_heavy": first is not None and first < s.last_heavy,
      "sequence": s.sequence(), "kernels": s.kernels,
  }


def _compile_variant(size, target, mesh, kind: str, name: str, batch: int, *, rank: int = 0,
                     adam: bool = False, shard: bool = False, options=None):
  """Builds and compiles one variant; its analysis (or the error that stopped it)."""
  from lab import aot

  comm = aot.communicator(kind, target, list(mesh.devices.flat), rank=rank)
  flags = {} if name == "memory" else _variant(name)
  sync_bn = flags.pop("sync_bn", True)
  try:
    tx = _optimizer(size, comm, batch * target.gpus, adam=adam, shard_optimizer=shard, **flags)
    step, args = aot.train_step(comm, _model(size, comm, sync_bn), tx, batch_per_gpu=batch,
                                image_shape=(size["image"], size["image"], 3),
                                mesh=mesh if kind == "xla" else None, label_smoothing=0.1)
    compiled = aot.compile(step, args, compiler_options=options)
  except Exception as error:  # noqa: BLE001 (recorded: the bench goes on)
    return {"error": f"{type(error).__name__}: {str(error)[:1500]}"}
  _save(f"{target}_{kind}_{name}_{batch}_rank{rank}{'_adam' if adam else ''}"
        f"{'_shard' if shard else ''}{'_options' if options else ''}", compiled.text)
  out = _analyse(compiled, step, args, target.gpu, mpi=kind != "xla")
  out["state_bytes"] = _state_bytes(args[0])
  out["batch_bytes"] = sum(int(a.size) * a.dtype.itemsize for a in args[1:]) // (
      target.gpus if kind == "xla" else 1)
  return out


_SAVE = {"dir": ""}


def _save(name: str, text: str) -> None:
  if _SAVE["dir"]:
    Path(_SAVE["dir"]).mkdir(parents=True, exist_ok=True)
    Path(_SAVE["dir"], f"{name}.hlo").write_text(text)


def _state_bytes(state) -> dict:
  import jax

  def nbytes(tree):
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))

  return {"params": nbytes(state.params), "batch_stats": nbytes(state.batch_stats),
          "opt_state": nbytes(state.opt_state), "step": nbytes(state.step)}


def _plain_jax(size, target, mesh, batch: int) -> dict:
  """flax ResNet with nn.BatchNorm, the same optimizer, plain jax.jit over the mesh."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from lab import aot
  from lab.runner._classifier import _train_step, create_train_state
  from mnjax.optim import recipes

  model = _model(size, None, sync_bn=False)
  global_batch = batch * target.gpus
  tx = recipes.goyal_sgd(global_batch, max(1, IMAGENET_TRAIN // global_batch))
  shape = (size["image"], size["image"], 3)
  state = jax.eval_shape(lambda: create_train_state(model, tx, jnp.zeros((1, *shape)),
                                                    jax.random.key(0)))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
  args = (aot.abstract(state, replicated),
          jax.ShapeDtypeStruct((global_batch, *shape), jnp.float32, sharding=split),
          jax.ShapeDtypeStruct((global_batch,), jnp.int32, sharding=split))
  step = jax.jit(functools.partial(_train_step, label_smoothing=0.1))
  compiled = aot.compile(step, args, global_flops=True, devices=target.gpus)
  _save(f"{target}_plain_jax_{batch}", compiled.text)
  return _analyse(compiled, step, args, target.gpu)


def _bucket_plan(size) -> dict:
  import jax
  import jax.numpy as jnp

  from lab.costmodel import step as step_model
  from mnjax.comm._instep._buckets import DEFAULT_BUCKET_BYTES

  model = _model(size, None, sync_bn=False)
  image = jnp.zeros((1, size["image"], size["image"], 3))
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), image, train=False))["params"]
  sizes = step_model.planned_buckets(params, DEFAULT_BUCKET_BYTES["gpu"])
  return {"bucket_bytes": DEFAULT_BUCKET_BYTES["gpu"], "buckets": len(sizes), "sizes": sizes,
          "gradient_bytes": sum(sizes)}


def _mpi_kinds(size, target, batch: int) -> dict:
  """The MPI kinds' programs (mpi4jax's CUDA custom calls), one process's: ``flat`` on
  `target`, the kinds of one process per node on ``size["mpi_target"]`` (several nodes:
  on one node they exchange nothing over MPI)."""
  from lab import aot

  out = {}
  for kind in ("flat", "hierarchical", "two_dimensional"):
    where = target if kind == "flat" else aot.parse_target(size["mpi_target"])
    per = 1 if aot.KIND_PROCESSES[kind] == "gpu" else where.gpus_per_node
    out[kind] = _compile_variant(size, where, aot.mesh(where, per_process=per), kind,
                                 "sync_bn_allreduce_fp32", batch)
    out[kind]["target"] = str(where)
  return out


def _order(size, target, mesh, batch: int) -> dict:
  """Every process issues the same collectives in the same order."""
  from lab import aot

  last = target.gpus - 1
  lowered = {}
  for rank in (0, last):  # xla: one SPMD program; its lowering must not depend on the rank
    comm = aot.communicator("xla", target, list(mesh.devices.flat), rank=rank)
    tx = _optimizer(size, comm, batch * target.gpus)
    step, args = aot.train_step(comm, _model(size, comm, True), tx, batch_per_gpu=batch,
                                image_shape=(size["image"], size["image"], 3), mesh=mesh,
                                label_smoothing=0.1)
    lowered[rank] = step.lower(*args).as_text()
  flat = aot.mesh(target)
  shard = {rank: _compile_variant(size, target, flat, "flat", "sync_bn_allreduce_fp32", batch,
                                  rank=rank, adam=True, shard=True) for rank in (0, last)}
  sequences = [r.get("sequence") for r in shard.values()]
  return {"xla_lowering_identical": lowered[0] == lowered[last],
          "flat_shard_optimizer": {"ranks": [0, last], "calls": len(sequences[0] or ()),
                                   "identical": sequences[0] is not None
                                   and sequences[0] == sequences[1],
                                   "errors": [r["error"] for r in shard.values() if "error" in r]}}


def _memory_section(quick: bool, spec: str, memory_fraction: float, save_hlo: str) -> dict:
  """The memory section (flat kind, `lab.bench.aot_memory`) on `spec`; a process of its
  own with ``--jobs 2``."""
  from lab import aot
  from lab.bench import aot_memory

  size = SIZES["quick" if quick else "full"]
  _SAVE["dir"] = save_hlo
  _no_cache()
  target = aot.parse_target(spec)
  compile_at = functools.partial(_compile_variant, size, target, aot.mesh(target), "flat",
                                 "memory")
  return aot_memory.memory(compile_at, size["memory_batches"],
                           memory_fraction * aot_memory.device_memory(target.gpu),
                           size["search"])


def _start_memory(args, target):
  """The memory section: now (``--jobs 1``) or in a second process (a future)."""
  job = (args.quick, str(target), args.memory_fraction, args.save_hlo)
  if args.jobs < 2:
    return _memory_section(*job)
  import concurrent.futures
  import multiprocessing

  pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
  future = pool.submit(_memory_section, *job)
  pool.shutdown(wait=False)
  return future


def run(args) -> dict:
  """Every section, as the JSON `main` writes; written to ``--out`` after each compile, most
  telling first, so that a run cut short keeps what it compiled."""
  from lab import aot

  size = SIZES["quick" if args.quick else "full"]
  _SAVE["dir"] = args.save_hlo
  targets = [aot.parse_target(t) for t in (args.targets or size["targets"])]
  results = {"benchmark": "aot", "size": "quick" if args.quick else "full",
             "config": {k: v for k, v in size.items() if k != "targets"},
             "date": time.strftime("%Y-%m-%d"), "targets": {}}
  results["bucket_plan"] = _bucket_plan(size)
  memory = _start_memory(args, targets[0])
  entries = {str(t): {"xla": {}} for t in targets}
  results["targets"] = entries

  def xla(target, name, **options):
    r = _compile_variant(size, target, aot.mesh(target), "xla", name, size["batch"], **options)
    _progress(target, name, r)
    _write(args.out, results)
    return r

  def plain(target):
    entries[str(target)]["plain_jax"] = r = _plain_jax(size, target, aot.mesh(target),
                                                       size["batch"])
    _progress(target, "plain_jax", r)
    _write(args.out, results)

  first, first_entry = targets[0], entries[str(targets[0])]
  for name in ("sync_bn_allreduce_fp32", "sync_bn_double_buffering_fp32"):  # the summary's
    first_entry["xla"][name] = xla(first, name)
  plain(first)
  for name in ("local_bn_allreduce_fp32", "local_bn_double_buffering_fp32",
               "sync_bn_allreduce_bf16"):
    first_entry["xla"][name] = xla(first, name)
  first_entry["xla"]["shard_optimizer"] = xla(first, "sync_bn_allreduce_fp32", shard=True)
  threshold = results["bucket_plan"]["bucket_bytes"]
  first_entry["combine_threshold"] = {
      "xla_gpu_all_reduce_combine_threshold_bytes": threshold,
      **xla(first, "sync_bn_allreduce_fp32",
            options={"xla_gpu_all_reduce_combine_threshold_bytes": threshold})}
  first_entry["mpi_kinds"] = _mpi_kinds(size, first, size["batch"])
  _write(args.out, results)
  first_entry["order"] = _order(size, first, aot.mesh(first), size["batch"])
  _write(args.out, results)
  for target in targets[1:]:
    for name in EVERY_TARGET[:-1]:
      entries[str(target)]["xla"][name] = xla(target, name)
    plain(target)
  first_entry["memory"] = memory
  if not isinstance(memory, dict):  # the second process's result
    try:
      first_entry["memory"] = memory.result()
    except Exception as error:  # noqa: BLE001 (recorded like a failed compile)
      first_entry["memory"] = {"error": f"{type(error).__name__}: {str(error)[:1500]}"}
  return results


def _write(out: str, results: dict) -> None:
  Path(out).parent.mkdir(parents=True, exist_ok=True)
  Path(out).write_text(json.dumps(results, indent=2, default=str))


def _progress(target, name: str, r: dict) -> None:
  what = r.get("error", f"overlap {r.get('overlap', 0):.3f}, {r.get('compile_seconds')} s")
  print(f"  compiled {target} {name}: {what[:200]}", file=sys.stderr, flush=True)


def _no_cache() -> None:
  """Deviceless executables cannot be read back from JAX's persistent cache (it would warn)."""
  import jax

  jax.config.update("jax_enable_compilation_cache", False)


def main(argv: list[str]) -> None:
  args = _parse(argv)
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin, no driver
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # run nothing: compile for the topology only
  from lab import aot
  from lab.bench import aot_report

  _no_cache()
  try:
    aot.topology("1xH200")
  except aot.AotUnavailable as error:
    sys.exit(str(error))
  start = time.monotonic()
  results = run(args)
  aot_report.finish(results)
  results["wall_seconds"] = round(time.monotonic() - start, 1)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=2))
  aot_report.table(results)
  print(f"results in {args.out}")
  print(aot_report.summary(results))


if __name__ == "__main__":
  main(sys.argv[1:])
