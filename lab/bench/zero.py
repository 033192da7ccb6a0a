"""Optimizer-state sharding (ZeRO-1) against the replicated optimizer, side by side in one run.

    python -m lab.bench zero                      # 1, 2, 3 ranks; prints tables, writes JSON
    python -m lab.bench zero --ranks 1,2 --smoke  # a quick run (CI)

For each rank count the script re-launches itself under ``mpirun -n P`` (``--bind-to core``
while there are cores for the ranks, unbound beyond) and compares, in the same processes,
``mnjax.shard_optimizer(optax.adam(1e-3), comm)`` ("sharded") with
``optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))`` ("unsharded") on:

1. **the digits CNN** (`lab.models.SmallCNN`, 151k float32 parameters): the whole train
   step on a real batch of digits per rank;
2. **a ResNet-50-sized tree** (its 161 parameter shapes, `launch.resnet50_shapes`, 25.6M
   float32): **the optimizer update step only** (``tx.update`` on a fixed random gradient
   tree + ``optax.apply_updates``; no forward or backward pass, which would not fit the
   time of a 2-core machine), so its times are the update's and its exchange's.

Per rank count and workload it reports the bytes of optimizer state a rank holds (measured:
the sum of the ``nbytes`` of the state pytree's leaves, the largest over the ranks) and the
step time (alternating rounds, the slowest rank's time, median over rounds:
`lab.bench.rounds.time_rounds`), and the ratios sharded / unsharded of both. The model of
the same step is `lab.costmodel.step.step_time(..., shard_optimizer=True)`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

WORKLOADS = ("digits_cnn", "resnet50_update")
VARIANTS = ("unsharded", "sharded")


def _ranks(text: str) -> list[int]:
  try:
    ranks = sorted({int(r) for r in text.split(",") if r.strip()})
  except ValueError:
    ranks = []
  if not ranks or ranks[0] < 1:
    raise argparse.ArgumentTypeError(f"--ranks takes rank counts >= 1 separated by commas"
                                     f" (e.g. 1,2,3), got {text!r}")
  return ranks


def _parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m lab.bench zero",
                              description=__doc__.split("\n")[0])
  p.add_argument("--ranks", type=_ranks, default=[1, 2, 3], help="rank counts, e.g. 1,2,3")
  p.add_argument("--batch_per_rank", type=int, default=32, help="digits per rank per step")
  p.add_argument("--steps", type=int, default=30, help="digits CNN steps per timed round")
  p.add_argument("--rounds", type=int, default=9, help="digits CNN timed rounds per variant")
  p.add_argument("--big_steps", type=int, default=2, help="ResNet-50 updates per timed round")
  p.add_argument("--big_rounds", type=int, default=5, help="ResNet-50 timed rounds per variant")
  p.add_argument("--big_leaves", type=int, default=0,
                 help="only the first N of ResNet-50's 161 leaves (0: all)")
  p.add_argument("--smoke", action="store_true",
                 help="1 round of 2 steps each, the first 12 ResNet-50 leaves")
  p.add_argument("--out", default="runs/bench/zero.json", help="JSON results")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.rounds, args.big_steps, args.big_rounds = 2, 1, 1, 1
    args.big_leaves = args.big_leaves or 12
  return args


def _variants(comm):
  import optax

  import mnjax

  return {"unsharded": optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3)),
          "sharded": mnjax.shard_optimizer(optax.adam(1e-3), comm)}


def state_bytes(tree) -> int:
  """Bytes an optimizer state holds on this rank: the sum of its leaves' ``nbytes``.

  Example:
    >>> state_bytes(optax.adam(1e-3).init({"w": jnp.ones((3, 2))}))   # count + mu + nu
    52
  """
  import jax

  return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


def _row(comm, states: dict, seconds: dict[str, float]) -> dict:
  """Per variant: state bytes on every rank, the largest, step seconds; and the ratios."""
  per_rank = {name: comm.mpi_comm.allgather(state_bytes(s)) for name, s in states.items()}
  row = {"state_bytes_per_rank": {k: max(v) for k, v in per_rank.items()},
         "state_bytes_each_rank": per_rank, "seconds_per_step": seconds}
  row["state_ratio"] = row["state_bytes_per_rank"]["sharded"] / row["state_bytes_per_rank"][
      "unsharded"]
  row["time_ratio"] = seconds["sharded"] / seconds["unsharded"]
  return row


def _digits(comm, args) -> dict:
  import jax
  import numpy as np

  from lab.bench.step import _time_variants
  from lab.models import SmallCNN

  variants = _variants(comm)
  params = SmallCNN().init(jax.random.key(0), np.zeros((1, 8, 8, 1)))["params"]
  states = {name: tx.init(params) for name, tx in variants.items()}
  row = _row(comm, states, _time_variants(variants, comm, args))
  row["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
  return row


def _resnet_update(comm, args) -> dict:
  import jax
  import optax

  from lab.bench.launch import resnet50_shapes
  from lab.bench.rounds import time_rounds

  shapes = resnet50_shapes()[: args.big_leaves or None]
  keys = jax.random.split(jax.random.key(0), len(shapes))
  params = [jax.random.normal(k, s) * 0.05 for k, s in zip(keys, shapes)]
  grads = [jax.random.normal(jax.random.fold_in(k, comm.rank + 1), s) * 1e-3
           for k, s in zip(keys, shapes)]
  states, runs = {}, {}
  for name, tx in _variants(comm).items():

    def update(state, grads, tx=tx):
      params, opt_state = state
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    step = jax.jit(update, donate_argnums=0)
    opt_state = tx.init(params)
    state = (jax.tree.map(lambda x: x.copy(), params), opt_state)
    state = step(state, grads)  # compile and warm up
    states[name] = jax.block_until_ready(step(state, grads))
    runs[name] = lambda state, step=step: step(state, grads)
  seconds = time_rounds(states, runs, comm.mpi_comm, rounds=args.big_rounds,
                        steps=args.big_steps)
  row = _row(comm, {name: s[1] for name, s in states.items()}, seconds)
  row["params"] = int(sum(p.size for p in params))
  row["leaves"] = len(shapes)
  return row


def _worker(args) -> dict:
  import mnjax

  comm = mnjax.create_communicator("flat")
  return {"ranks": comm.size, "digits_cnn": _digits(comm, args),
          "resnet50_update": _resnet_update(comm, args)}


def _table(rows: list[dict], workload: str) -> list[str]:
  lines = [f"{'ranks':>5s} {'state/rank unsharded':>21s} {'sharded':>11s} {'ratio':>6s}"
           f" {'ms/step unsharded':>18s} {'sharded':>9s} {'ratio':>6s}"]
  for r in rows:
    w = r[workload]
    b, s = w["state_bytes_per_rank"], w["seconds_per_step"]
    lines.append(f"{r['ranks']:5d} {b['unsharded'] / 1e6:18.3f} MB {b['sharded'] / 1e6:8.3f} MB"
                 f" {w['state_ratio']:6.3f} {s['unsharded'] * 1e3:18.2f}"
                 f" {s['sharded'] * 1e3:9.2f} {w['time_ratio']:6.3f}"
                 f"{'' if r['bound'] else '  (ranks share cores)'}")
  return lines


def main(argv: list[str]) -> None:
  args = _parse(argv)
  if args.worker:
    from mpi4py import MPI

    result = _worker(args)
    if MPI.COMM_WORLD.rank == 0:
      print(json.dumps(result))
    return
  from lab.bench.launch import relaunch

  cores = os.cpu_count() or 1
  worker = ["--batch_per_rank", str(args.batch_per_rank), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--big_steps", str(args.big_steps),
            "--big_rounds", str(args.big_rounds), "--big_leaves", str(args.big_leaves),
            "--worker"]
  rows = []
  for p in args.ranks:
    bound = p <= cores
    rows.append({**relaunch("zero", worker, ranks=p, bind="core" if bound else "none"),
                 "bound": bound})
  first = rows[0]
  big = first["resnet50_update"]
  print(f"digits CNN train step ({first['digits_cnn']['params']:,} params, adam,"
        f" {args.batch_per_rank} images/rank); {cores} cores")
  print("\n".join(_table(rows, "digits_cnn")))
  print(f"ResNet-50-sized tree, optimizer update step only ({big['leaves']} leaves,"
        f" {big['params']:,} float32 params, adam, random gradients)")
  print("\n".join(_table(rows, "resnet50_update")))
  result = {"benchmark": "zero", "cores": cores, "optimizer": "adam(1e-3)",
            "variants": {"unsharded": "optax.chain(allreduce_gradients(comm), adam)",
                         "sharded": "shard_optimizer(adam, comm)"},
            "workloads": {"digits_cnn": "SmallCNN train step on digits, real batch",
                          "resnet50_update": "tx.update + apply_updates only, ResNet-50 shapes,"
                                             " random gradients"},
            "batch_per_rank": args.batch_per_rank, "steps_per_round": args.steps,
            "rounds": args.rounds, "big_steps_per_round": args.big_steps,
            "big_rounds": args.big_rounds, "smoke": args.smoke, "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=2))
  print(f"results in {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
