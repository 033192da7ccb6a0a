"""Allreduce methods side by side, 4 B to 128 MB, and fused vs per-tensor on ResNet-50 shapes.

    python -m lab.bench allreduce              # 2 ranks; prints tables, writes JSON
    python -m lab.bench allreduce --max_bytes 1e6 --rounds 3   # a quick look

Re-launches itself twice under ``mpirun --bind-to core -n RANKS``: once for the MPI methods,
once for JAX's own ``psum`` (jax.distributed + gloo, which must not share a process with the
others: it reroutes every CPU collective). Methods, on one float32 buffer of each size:

* ``raw_mpi``: mpi4py ``Allreduce(send, recv)`` on preallocated numpy buffers, the practical
  limit here (``raw_mpi_in_place``: the same with ``MPI.IN_PLACE``);
* ``mpi4jax``: ``mpi4jax.allreduce`` in a jitted function (ordered effect);
* ``mnjax_fp32``: ``allreduce_tree`` in a jitted function whose input is donated, as a
  gradient is inside a train step (``mnjax_fp32_copy``: input kept alive, so XLA copies it
  into a fresh buffer first — what a standalone call without donation pays);
* ``mnjax_bf16``, ``mnjax_fp16``: the same with ``wire_dtype`` (float32 in and out);
* ``bf16_exchange_only``: just the alltoall + allgather of those 16-bit buffers, without the
  float32 -> bfloat16 -> float32 passes (what the wire itself costs);
* ``jax_psum``: ``jax.lax.psum`` over a global mesh (gloo on CPU).

``--tuned_malloc`` runs the workers with `TUNED_MALLOC` (glibc keeps buffers above 32 MB in
one heap instead of a fresh mmap per allocation; see docs/design/allreduce.md).

Time per call = the slowest rank's, median over rounds (methods alternate inside a round).
Bus bandwidth = 2 (p-1)/p x float32 bytes / time (NCCL's convention, so half-precision
methods show their speed-up as bandwidth). Ratios are raw_mpi time / method time (> 1:
faster than raw MPI).

The second table reduces ResNet-50's 161 real parameter shapes (`launch.resnet50_shapes`)
against raw MPI on one preallocated buffer (``raw_mpi_fused``; ``_in_place``: the same with
``MPI.IN_PLACE``) and raw MPI in place on one preallocated buffer per leaf
(``raw_mpi_per_leaf``: leaf-sized messages stay in the CPU caches, which one 102 MB
message does not, so this is the fair limit for a per-leaf plan): one mpi4jax call per leaf,
one mnjax call per leaf (``bucket_bytes=1``),
the platform's default plan (``mnjax_default``, `mnjax.comm._instep._buckets.default_bucket_bytes`),
buckets of several sizes, one fused buffer (``bucket_bytes=None``), bf16 on the wire
with one buffer and with the default buckets, and the exact sum of ``replicas=P``
(``mnjax_default_exact``: the same bits at any number of processes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

RESNET50_FP32 = 25_557_032 * 4
SIZES = (4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
         RESNET50_FP32 // 2, 64 << 20, RESNET50_FP32, 128 << 20)
SWEEP = ("raw_mpi", "raw_mpi_in_place", "mpi4jax", "mnjax_fp32", "mnjax_fp32_copy",
         "mnjax_bf16", "mnjax_fp16", "bf16_exchange_only")
BUCKETS = {"64kB": 64 << 10, "256kB": 256 << 10, "1MB": 1 << 20, "4MB": 4 << 20,
           "25MB": 25 << 20}
# glibc: one arena, no mmap below 1 GiB, no trimming, so large buffers are reused, not
# page-faulted afresh on every call.
TUNED_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m lab.bench allreduce",
                              description=__doc__.split("\n")[0])
  p.add_argument("--ranks", type=int, default=2)
  p.add_argument("--max_bytes", type=float, default=128 << 20, help="largest message")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--seconds", type=float, default=0.05, help="target seconds per timed round")
  p.add_argument("--no_psum", action="store_true", help="skip the jax.distributed launch")
  p.add_argument("--tuned_malloc", action="store_true", help="workers run with TUNED_MALLOC")
  p.add_argument("--no_resnet50", action="store_true", help="skip the ResNet-50 table")
  p.add_argument("--resnet50_fraction", type=float, default=1.0,
                 help="each of ResNet-50's 161 leaves cut to this fraction of its elements"
                      " (smoke runs; 1: the real sizes)")
  p.add_argument("--share_devices", action="store_true",
                 help="ranks may share a GPU (create_communicator(share_devices=True))")
  p.add_argument("--bind", default="core", help="mpirun --bind-to (none: off)")
  p.add_argument("--out", default="runs/bench/allreduce.json")
  p.add_argument("--worker", choices=("mpi", "psum"), help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _time(fns: dict, state: dict, host, rounds: int, seconds: float) -> dict[str, float]:
  """Median over rounds of the slowest rank's seconds per call; each fn maps state -> state."""
  import jax
  from mpi4py import MPI

  calls = {}
  for name, fn in fns.items():  # compile, warm up, and size the rounds
    state[name] = jax.block_until_ready(fn(state[name]))
    start = time.perf_counter()
    state[name] = jax.block_until_ready(fn(state[name]))
    once = host.allreduce(time.perf_counter() - start, op=MPI.MAX)
    calls[name] = host.bcast(max(1, min(2000, int(seconds / max(once, 1e-7)))))
  samples = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      x = state[name]
      host.Barrier()
      start = time.perf_counter()
      for _ in range(calls[name]):
        x = fn(x)
      jax.block_until_ready(x)
      samples[name].append(host.allreduce((time.perf_counter() - start) / calls[name], op=MPI.MAX))
      state[name] = x
  return {name: statistics.median(s) for name, s in samples.items()}


def _sweep_fns(n: int, comm) -> tuple[dict, dict]:
  import jax
  import jax.numpy as jnp
  import mpi4jax
  import numpy as np
  from mpi4py import MPI

  from mnjax.comm._instep import _primitives as mpi_ops
  from mnjax.comm._instep._allreduce import allreduce_tree

  mpi, host = comm.device_comm, comm.mpi_comm
  send, recv = np.ones(n, np.float32), np.empty(n, np.float32)

  def raw(x):
    host.Allreduce(send, recv)
    return x

  def raw_in_place(x):
    host.Allreduce(MPI.IN_PLACE, recv)
    return x

  def tree_fn(**kw):
    return lambda t: allreduce_tree(t, comm, mean=False, **kw)

  copy_fn, kept = jax.jit(tree_fn()), jnp.ones((n,))
  fns = {
      "raw_mpi": raw,
      "raw_mpi_in_place": raw_in_place,
      "mpi4jax": jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=mpi)),
      "mnjax_fp32": jax.jit(tree_fn(), donate_argnums=0),
      "mnjax_fp32_copy": lambda _: copy_fn(kept),
      "mnjax_bf16": jax.jit(tree_fn(wire_dtype=jnp.bfloat16), donate_argnums=0),
      "mnjax_fp16": jax.jit(tree_fn(wire_dtype=jnp.float16), donate_argnums=0),
      "bf16_exchange_only": jax.jit(
          lambda x: mpi_ops.allgather(mpi_ops.alltoall(x, mpi)[0], mpi), donate_argnums=0),
  }
  # Small values: repeated sums stay finite for the whole run (Inf would be as fast, but
  # keep the arithmetic ordinary).
  state = {name: jnp.full((n,), 1e-30, jnp.float32) for name in fns}
  state["raw_mpi"] = state["raw_mpi_in_place"] = state["mnjax_fp32_copy"] = None
  parts = comm.size
  state["bf16_exchange_only"] = jnp.zeros((parts, -(-n // parts)), jnp.bfloat16)
  return fns, state


def _resnet_shapes(fraction: float) -> list[tuple[int, ...]]:
  """ResNet-50's leaf shapes, or flat leaves of `fraction` of their elements (at least 1)."""
  from lab.bench.launch import resnet50_shapes

  shapes = resnet50_shapes()
  if fraction >= 1:
    return shapes
  return [(max(1, int(math.prod(s) * fraction)),) for s in shapes]


def _resnet_fns(comm, fraction: float = 1.0) -> tuple[dict, dict]:
  import jax
  import jax.numpy as jnp
  import mpi4jax
  import numpy as np
  from mpi4py import MPI

  import mnjax
  from mnjax.comm._instep._allreduce import allreduce_tree

  shapes = _resnet_shapes(fraction)
  mpi = comm.device_comm
  total = sum(math.prod(s) for s in shapes)
  send, recv = np.ones(total, np.float32), np.empty(total, np.float32)

  def raw(x):
    comm.mpi_comm.Allreduce(send, recv)
    return x

  def raw_in_place(x):
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, recv)
    return x

  leaf_bufs = [np.empty(math.prod(s), np.float32) for s in shapes]

  def raw_per_leaf(x):  # in place, like mnjax's handler, on preallocated numpy buffers
    for buf in leaf_bufs:
      comm.mpi_comm.Allreduce(MPI.IN_PLACE, buf)
    return x

  def per_leaf_mpi4jax(tree):
    return jax.tree.map(lambda g: mpi4jax.allreduce(g, op=MPI.SUM, comm=mpi), tree)

  def tree_fn(**kw):
    return jax.jit(lambda t: allreduce_tree(t, comm, mean=False, **kw), donate_argnums=0)

  fns = {"raw_mpi_fused": raw, "raw_mpi_fused_in_place": raw_in_place,
         "raw_mpi_per_leaf": raw_per_leaf,
         "mpi4jax_per_leaf": jax.jit(per_leaf_mpi4jax),
         "mnjax_per_leaf": tree_fn(bucket_bytes=1)}
  fns["mnjax_default"] = tree_fn()
  fns.update({f"mnjax_bucket_{label}": tree_fn(bucket_bytes=n) for label, n in BUCKETS.items()})
  fns["mnjax_fused"] = tree_fn(bucket_bytes=None)
  fns["mnjax_fused_bf16"] = tree_fn(bucket_bytes=None, wire_dtype=jnp.bfloat16)
  fns["mnjax_default_bf16"] = tree_fn(wire_dtype=jnp.bfloat16)
  # The exact sum (create_communicator(..., replicas=P): two int32 limbs per element and
  # the exponent histogram): the same bits on any number of processes.
  exact = mnjax.create_communicator("flat", replicas=comm.size)
  fns["mnjax_default_exact"] = jax.jit(lambda t: allreduce_tree(t, exact, mean=False),
                                       donate_argnums=0)
  state = {name: [jnp.full(s, 1e-30, jnp.float32) for s in shapes] for name in fns}
  return fns, state


def _mpi_worker(args) -> dict:
  import mnjax

  comm = mnjax.create_communicator("flat", share_devices=args.share_devices)
  host = comm.mpi_comm
  sweep = []
  for nbytes in SIZES:
    if nbytes > args.max_bytes:
      break
    fns, state = _sweep_fns(max(1, nbytes // 4), comm)
    sweep.append({"bytes": nbytes, "seconds": _time(fns, state, host, args.rounds, args.seconds)})
    del fns, state
  if args.no_resnet50:
    return {"ranks": comm.size, "sweep": sweep}
  fns, state = _resnet_fns(comm, args.resnet50_fraction)
  resnet = _time(fns, state, host, args.rounds, args.seconds)
  return {"ranks": comm.size,
          "sweep": sweep, "resnet50": resnet}


def _psum_worker(args) -> dict:
  import mnjax

  comm = mnjax.create_communicator("xla")  # jax.distributed first: before JAX is used
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = comm.mesh
  sharding = NamedSharding(mesh, P(comm.axis_name))
  sweep = []
  for nbytes in SIZES:
    if nbytes > args.max_bytes:
      break
    n = max(1, nbytes // 4)
    local = jnp.full((1, n), 1e-30, jnp.float32)
    x = jax.make_array_from_single_device_arrays(
        (comm.num_replicas, n), sharding, [jax.device_put(local, d) for d in comm.devices])
    fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, comm.axis_name), mesh=mesh,
                               in_specs=P(comm.axis_name), out_specs=P(comm.axis_name)),
                 donate_argnums=0)
    secs = _time({"jax_psum": fn}, {"jax_psum": x}, comm.mpi_comm, args.rounds, args.seconds)
    sweep.append({"bytes": nbytes, "seconds": secs})
  return {"sweep": sweep}


def _report(results: dict) -> None:
  ranks = results["mpi"]["ranks"]
  psum = {row["bytes"]: row["seconds"]["jax_psum"]
          for row in results.get("psum", {}).get("sweep", [])}
  methods = list(SWEEP) + (["jax_psum"] if psum else [])
  print(f"allreduce of one float32 buffer, {ranks} ranks; per method: time and ratio to raw_mpi"
        " (> 1 is faster); bus bandwidth for >= 1 MB")
  print(f"{'bytes':>11s} " + " ".join(f"{m:>20s}" for m in methods))
  for row in results["mpi"]["sweep"]:
    secs = dict(row["seconds"],
                **({"jax_psum": psum[row["bytes"]]} if row["bytes"] in psum else {}))
    raw = secs["raw_mpi"]
    cells = []
    for m in methods:
      t = secs.get(m)
      if t is None:
        cells.append(f"{'-':>20s}")
      elif row["bytes"] >= 1 << 20:
        busbw = 2 * (ranks - 1) / ranks * row["bytes"] / t / 1e9
        cells.append(f"{busbw:7.2f} GB/s ({raw / t:4.2f}x)")
      else:
        cells.append(f"{t * 1e6:8.1f} us ({raw / t:4.2f}x)")
    print(f"{row['bytes']:>11,d} " + " ".join(f"{c:>20s}" for c in cells))
  if "resnet50" not in results["mpi"]:
    return
  r50 = results["mpi"]["resnet50"]
  print("\nResNet-50 gradient (161 leaves, 25.6M float32): time per allreduce")
  for name, t in r50.items():
    print(f"  {name:22s} {t * 1e3:9.2f} ms   {r50['mnjax_per_leaf'] / t:5.2f}x vs mnjax per leaf,"
          f" {r50['raw_mpi_fused'] / t:5.2f}x vs raw MPI fused")


def measure(argv: list[str], *, timeout: float = 1800) -> dict:
  """Runs the benchmark's launches (MPI methods; then psum unless ``--no_psum``) -> results.

  Args:
    argv: the benchmark's options, as on its command line.
    timeout: seconds each mpirun launch may take.

  Example:
    >>> measure(["--max_bytes", "1e6", "--no_psum"])["mpi"]["sweep"][-1]["bytes"]  # doctest: +SKIP
    1048576
  """
  import os

  from lab.bench.launch import relaunch

  args = _parse(argv)
  env = TUNED_MALLOC if args.tuned_malloc else {}
  results = {"benchmark": "allreduce", "launch": f"mpirun --bind-to {args.bind} -n {args.ranks}",
             "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC} | env}
  for worker in ("mpi",) if args.no_psum else ("mpi", "psum"):
    results[worker] = relaunch("allreduce", [*argv, "--worker", worker], ranks=args.ranks,
                               bind=args.bind, env=env, timeout=timeout)
  return results


def main(argv):
  args = _parse(argv)
  if args.worker:

    result = (_mpi_worker if args.worker == "mpi" else _psum_worker)(args)
    import mpi4py.MPI as MPI

    if MPI.COMM_WORLD.rank == 0:
      print(json.dumps(result))
    return
  results = measure(argv)
  _report(results)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=2))
  print(f"results in {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
