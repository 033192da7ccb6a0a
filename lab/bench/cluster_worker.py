"""One job of ``python -m lab.bench cluster`` and of tests/jobs/test_cluster.py: a step that
only exchanges gradients (`allreduce_gradients` + SGD on a flat float32 vector), timed, with
each node's uplink bytes read around the timed steps.

``python -m lab.bench.cluster_worker --kind flat --params 1000000,4000000 --wire fp32,bf16
--steps 5 --out r.json`` under ``mpirun`` or ``python -m lab.cluster run``. Rank 0 writes
``{"runs": [{"before", "params", "wire", "seconds_per_step", "handler_seconds_per_step" and
"handler_idle_seconds" (with ``--handler-windows``, else null: the exchange per step and
the link's idle time between two, `lab.bench.handler_time`), "nodes": [{"node", "tx_bytes",
"rx_bytes"} per step], "params_sha256", "ranks_agree"}, ...], **runs[0]}``; outside a
namespace (no ``eth0``) ``nodes`` is null. ``--shard``: after those runs, the same with
`mnjax.shard_optimizer` (ZeRO-1's reduce-scatter + allgather; ``"optimizer": "shard"``).
``--before sleep,compute``: each run of every size again, each step after 10 ms
(``--before-ms``) of idle or of compute on every rank (`gap`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _counters() -> tuple[int, int] | None:
  base = Path("/sys/class/net/eth0/statistics")
  if not base.exists():
    return None
  return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


GAPS = ("none", "sleep", "compute_aligned", "compute")


def gap(mode: str, seconds: float, mpi_comm) -> Callable[[], None]:
  """What every rank does before each step with ``--before``: ``none`` (exchanges back to
  back), ``sleep`` (the link and the cores idle), ``compute`` (a chain of matrix products on
  XLA's threads, the same work on every rank, calibrated here to take about `seconds` with
  every rank computing: a step's compute before its exchange, the ranks leaving it as the
  shared cores let them) or ``compute_aligned`` (the same, then a barrier: the ranks enter
  the exchange together). Collective over `mpi_comm`."""
  if mode not in GAPS:
    raise ValueError(f"gap: one of {', '.join(GAPS)}, got {mode!r}")
  if mode == "none":
    return lambda: None
  if mode == "sleep":
    return lambda: time.sleep(seconds)
  import jax
  import jax.numpy as jnp
  from mpi4py import MPI

  @jax.jit
  def layers(a):
    for _ in range(4):
      a = jnp.tanh(a @ a / a.shape[0])
    return a

  a = jnp.ones((256, 256), jnp.float32)
  layers(a).block_until_ready()
  mpi_comm.Barrier()
  start = time.perf_counter()
  for _ in range(5):
    layers(a).block_until_ready()
  reps = max(1, round(seconds / mpi_comm.allreduce((time.perf_counter() - start) / 5,
                                                   op=MPI.MAX)))

  def run():
    for _ in range(reps):
      out = layers(a)
    out.block_until_ready()
    if mode == "compute_aligned":
      mpi_comm.Barrier()
  return run


def _measure(comm, n: int, wire: str | None, steps: int, shard: bool = False,
             local_baseline: bool = False, windows: int = 0, first=lambda: None) -> dict:
  """Per-step seconds and uplink bytes of `steps` steps (wire None: no exchange at all, or
  with `local_baseline` the gradient averaged over the process's own devices only, as the
  step benchmark's no-exchange step; `shard`: `mnjax.shard_optimizer`'s reduce-scatter +
  allgather instead of an allreduce); with `windows`, also the exchange per step from the
  handlers' events (`lab.bench.handler_time`, `windows` of `steps` steps). `first` runs
  before each step (`gap`)."""
  import jax
  import jax.numpy as jnp
  import optax
  from mpi4py import MPI

  import mnjax
  from lab.bench.handler_time import exchange_seconds
  world = MPI.COMM_WORLD
  dtype = jnp.bfloat16 if wire == "bf16" else None
  links = [] if wire is None else [mnjax.allreduce_gradients(comm, wire_dtype=dtype)]
  step_comm = comm
  if wire is None and local_baseline and comm.multi_device:   # this process's devices only
    step_comm = dataclasses.replace(comm, kind="single_node", size=1)
    links = [mnjax.allreduce_gradients(step_comm)]
  tx = optax.chain(*links, optax.sgd(0.1))
  if shard and wire is not None:
    tx = mnjax.shard_optimizer(optax.sgd(0.1), comm, wire_dtype=dtype)

  def step(params, opt_state, x):
    # The baseline leaves the batch out: without the exchange, replicas would differ.
    target = 1.0 if wire is None else jnp.mean(x)
    grads = jax.grad(lambda q: jnp.sum((q["w"] - target) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  run = mnjax.data_parallel(step, step_comm, batch_argnums=(2,))
  params = {"w": jnp.zeros((n,), jnp.float32)}
  opt_state = tx.init(params)
  rows = 2 * comm.local_device_count

  def batch(i):
    first = comm.rank * rows
    return (jnp.arange(first, first + rows, dtype=jnp.float32) + i)[:, None]

  params, opt_state = run(params, opt_state, batch(0))   # compile, first exchange
  jax.block_until_ready(params)
  world.Barrier()
  before = _counters()
  world.Barrier()  # no rank sends the next step's bytes before every node has read its counters
  start = time.perf_counter()
  for i in range(1, steps + 1):
    first()
    params, opt_state = run(params, opt_state, batch(i))
    jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  world.Barrier()
  after = _counters()
  handlers = idle = None
  if windows and wire is not None:
    def one(s):
      p, o, i = s
      jax.block_until_ready((p, o))   # the gap follows the last step, not beside it
      first()
      return (*run(p, o, batch(i)), i + 1)
    handlers, idle, (params, opt_state, _) = exchange_seconds(
        (params, opt_state, steps + 1), one, world, windows=windows, steps=steps)
  mine = None
  if before is not None and comm.intra_rank == 0:
    mine = {"node": comm.inter_rank, "tx_bytes": (after[0] - before[0]) / steps,
            "rx_bytes": (after[1] - before[1]) / steps}
  nodes = world.gather(mine, root=0)
  times = world.gather(seconds / steps, root=0)
  w = np.asarray(params["w"])
  digests = world.allgather(hashlib.sha256(w.tobytes()).hexdigest())
  return {"params": n, "wire": wire or "none", "optimizer": "shard" if shard else "allreduce",
          "seconds_per_step": max(times or [0]), "handler_seconds_per_step": handlers,
          "handler_idle_seconds": idle,
          "nodes": sorted((x for x in nodes or [] if x), key=lambda x: x["node"]) or None,
          "params_sha256": digests[0], "ranks_agree": len(set(digests)) == 1,
          "params_head": w[:4].tolist()}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m lab.bench.cluster_worker")
  p.add_argument("--kind", default="flat")
  p.add_argument("--wire", default="fp32", help="comma-separated: fp32, bf16")
  p.add_argument("--params", default="1000000", help="comma-separated vector lengths")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--baseline", action="store_true",
                 help="also time each size with no exchange (the step's own cost)")
  p.add_argument("--local-baseline", action="store_true",
                 help="the baseline averages over the process's own devices (multi-device "
                      "kinds): the exchange is then what crosses processes")
  p.add_argument("--handler-windows", type=int, default=0,
                 help="also time the exchange from the handlers' events, over this many "
                      "windows of --steps steps (lab.bench.handler_time)")
  p.add_argument("--before", default="none",
                 help=f"comma-separated, each a run of every size: {', '.join(GAPS)} "
                      "(`gap`): what each step follows")
  p.add_argument("--before-ms", type=float, default=10.0, help="the sleep's or compute's ms")
  p.add_argument("--shard", action="store_true",
                 help="also each size and wire with shard_optimizer(sgd) (the flat kind)")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)

  import mnjax
  comm = mnjax.create_communicator(args.kind)
  from mpi4py import MPI

  wires = args.wire.split(",")
  if not set(wires) <= {"fp32", "bf16"}:
    raise SystemExit(f"--wire: fp32 and/or bf16, got {args.wire!r}")
  if not set(args.before.split(",")) <= set(GAPS):
    raise SystemExit(f"--before: one or more of {', '.join(GAPS)}, got {args.before!r}")
  runs = []
  for mode in args.before.split(","):
    first = gap(mode, args.before_ms / 1e3, MPI.COMM_WORLD)
    for n in (int(x) for x in args.params.split(",")):
      for wire in [*wires, *([None] if args.baseline else [])]:
        runs.append({"before": mode, **_measure(
            comm, n, wire, args.steps, local_baseline=args.local_baseline,
            windows=args.handler_windows, first=first)})
  if args.shard:
    runs += [{"before": "none", **_measure(comm, n, wire, args.steps, shard=True)}
             for n in (int(x) for x in args.params.split(",")) for wire in wires]
  if MPI.COMM_WORLD.rank == 0:
    out = {"kind": args.kind, "ranks": MPI.COMM_WORLD.size, "before_ms": args.before_ms,
           "devices_per_rank": comm.local_device_count, "steps": args.steps, **runs[0],
           "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"cluster_worker: {json.dumps(out)[:2000]}", flush=True)


if __name__ == "__main__":
  main()
