"""Measured efficiency of the digits CNN step at 1..N ranks on this machine.

    python -m lab.bench scaling                       # 1, 2, 3, 4 ranks; writes JSON
    python -m lab.bench scaling --ranks 1 2 --steps 5 --rounds 2   # a smoke run

For each rank count above 1 it runs `python -m lab.bench step`'s worker under `mpirun`
(alternating rounds of the step with and without `allreduce_gradients`; the slowest rank's
time, median over rounds), and reports per rank count:

* communication efficiency = step time without communication / step time with it;
* weak-scaling efficiency = images/s on p ranks / (p x images/s of one rank alone).

Ranks are bound to cores while there are cores for them (``--bind-to core``); beyond that
they share cores, so weak scaling there measures the machine, not mnjax. The notebook
``notebooks/scaling`` plots the result next to the cost model's prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m lab.bench scaling",
                              description=__doc__.split("\n")[0])
  p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
  p.add_argument("--batch_per_rank", type=int, default=32)
  p.add_argument("--steps", type=int, default=30, help="steps per timed round")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--out", default="runs/bench/scaling.json")
  return p.parse_args(argv)


def _one_rank(args) -> float:
  """Seconds per step of one rank alone, plain optax (no communicator at all)."""
  import optax
  from mpi4py import MPI

  import mnjax
  from lab.bench import step

  comm = mnjax.create_communicator("flat", MPI.COMM_SELF)
  return step._time_variants({"plain": optax.adam(1e-3)}, comm, args)["plain"]


def _params() -> int:
  import jax
  import numpy as np

  from lab.models import SmallCNN

  variables = SmallCNN().init(jax.random.key(0), np.zeros((1, 8, 8, 1)))
  return int(sum(x.size for x in jax.tree.leaves(variables["params"])))


def main(argv):
  args = _parse(argv)
  if any(r < 1 for r in args.ranks):
    sys.exit(f"--ranks must all be >= 1, got {args.ranks}")
  from lab.bench.launch import relaunch

  cores = os.cpu_count() or 1
  one = _one_rank(args)
  rows = [{"ranks": 1, "seconds_no_communication": one, "seconds_allreduce": one,
           "communication_efficiency": 1.0, "weak_scaling_efficiency": 1.0, "bound": True}]
  common = ["--batch_per_rank", str(args.batch_per_rank), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--worker"]
  for p in sorted(set(args.ranks) - {1}):
    bound = p <= cores
    multi = relaunch("step", common, ranks=p, bind="core" if bound else "none")
    sec = multi["seconds_per_step"]
    rows.append({"ranks": p, "seconds_no_communication": sec["no_communication"],
                 "seconds_allreduce": sec["allreduce"],
                 "communication_efficiency": multi["efficiency"],
                 "weak_scaling_efficiency": one / sec["allreduce"], "bound": bound})
  print(f"digits CNN, {args.batch_per_rank} images/rank; {cores} cores")
  print(f"{'ranks':>5s} {'no comm (ms)':>13s} {'allreduce (ms)':>15s} {'comm eff':>9s}"
        f" {'weak scaling':>13s}")
  for r in rows:
    print(f"{r['ranks']:5d} {r['seconds_no_communication'] * 1e3:13.3f}"
          f" {r['seconds_allreduce'] * 1e3:15.3f} {r['communication_efficiency']:9.3f}"
          f" {r['weak_scaling_efficiency']:13.3f}{'' if r['bound'] else '  (ranks share cores)'}")
  result = {"benchmark": "scaling", "model": "SmallCNN on digits, adam", "cores": cores,
            "batch_per_rank": args.batch_per_rank, "params": _params(), "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=2))
  print(f"results in {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
