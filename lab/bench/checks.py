"""What the default-on safety checks cost a train step, measured side by side in one run.

    python -m lab.bench checks            # 2 ranks (re-launched under mpirun); table + JSON

The digits CNN step of the main job (``experiments/train.py``: 32 images per rank, adam,
`allreduce_gradients`) runs in alternating rounds as:

- ``unchecked``: ``optax.chain(allreduce_gradients(comm), adam)``, nothing else;
- ``skip_nonfinite``: adam wrapped in `mnjax.skip_nonfinite` (an ``isfinite`` reduction over
  the reduced gradient and a select per step);
- ``default_checks``: that, plus a running `mnjax.Watchdog` at its default 1 s heartbeat,
  ``watchdog.step(i)`` every step and `mnjax.optim.raise_if_diverging` on the previous step's
  state every 10 steps — what the experiment scripts run;
- ``watchdog_100x``: the same with a 10 ms heartbeat, 100 times the default rate, so that
  the thread's cost is visible at all (a round lasts about a second).

Overhead = (variant - unchecked) / unchecked, per step, median of rounds of the slowest
rank. The pre-flight check runs while the step is traced, never per step (tests count its
calls); `mnjax.check_replicas` runs once per epoch, so its time is reported per call and
spread over the digits epoch's 22 steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from mpi4py import MPI

import mnjax
from lab.bench.launch import relaunch
from lab.bench.rounds import time_rounds
from lab.models import SmallCNN
from lab.runner import create_train_state, train_step

STEPS_PER_DIGITS_EPOCH = 22  # 1,438 training images / 64 per step, as experiments/train.py


def _parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m lab.bench checks",
                              description=__doc__.split("\n")[0])
  p.add_argument("--batch_per_rank", type=int, default=32, help="examples per rank per step")
  p.add_argument("--steps", type=int, default=150, help="steps per timed round")
  p.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
  p.add_argument("--ranks", type=int, default=2, help="MPI ranks")
  p.add_argument("--bind", default="core", help="mpirun --bind-to (none: off)")
  p.add_argument("--out", default="runs/bench/checks.json", help="JSON results")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def measure(args) -> dict:
  comm = mnjax.create_communicator("flat")
  data = mnjax.data.load_digits("train")
  images = jnp.asarray(data.images[: args.batch_per_rank])
  labels = jnp.asarray(data.labels[: args.batch_per_rank])
  allreduce = mnjax.allreduce_gradients(comm)
  guarded = optax.chain(allreduce, mnjax.skip_nonfinite(optax.adam(1e-3)))
  variants = {"unchecked": optax.chain(allreduce, optax.adam(1e-3)), "skip_nonfinite": guarded,
              "default_checks": guarded, "watchdog_100x": guarded}
  states = {}
  for name, tx in variants.items():
    state = create_train_state(SmallCNN(), tx, images[:1], jax.random.key(0))
    for _ in range(3):  # compile and warm up
      state, _ = train_step(state, images, labels)
    states[name] = jax.block_until_ready(state)

  watchdogs: dict[str, mnjax.Watchdog] = {}

  def watched(name: str, interval: float):
    def context():  # a fresh watchdog (its own communicator) for each round
      watchdogs[name] = mnjax.Watchdog(comm, interval=interval,
                                       heartbeat_timeout=max(60.0, 3 * interval))
      return watchdogs[name]
    return context

  def checked(name: str):
    step = [0]

    def run(state):  # what the experiment loops do around each step
      step[0] += 1
      watchdogs[name].step(step[0])
      new = train_step(state, images, labels)[0]
      if step[0] % 10 == 0:  # as the experiments: the previous step's counter, every 10 steps
        mnjax.optim.raise_if_diverging(state.opt_state, max_consecutive_skips=10)
      return new
    return run

  plain = lambda state: train_step(state, images, labels)[0]  # noqa: E731
  sec = time_rounds(
      states,
      {"unchecked": plain, "skip_nonfinite": plain, "default_checks": checked("default_checks"),
       "watchdog_100x": checked("watchdog_100x")},
      comm.mpi_comm, rounds=args.rounds, steps=args.steps,
      around={"default_checks": watched("default_checks", 1.0),
              "watchdog_100x": watched("watchdog_100x", 0.01)})

  params = states["unchecked"].params
  calls = []
  for _ in range(20):
    comm.mpi_comm.Barrier()
    start = time.perf_counter()
    mnjax.check_replicas(params, comm)
    calls.append(comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
  replicas = sorted(calls)[len(calls) // 2]
  base = sec["unchecked"]
  return {
      "ranks": comm.size,
      "seconds_per_step": sec,
      "overhead": {k: v / base - 1 for k, v in sec.items() if k != "unchecked"},
      "check_replicas_seconds": replicas,
      "check_replicas_overhead_per_digits_epoch": replicas / (STEPS_PER_DIGITS_EPOCH * base),
  }


def main(argv: list[str]) -> None:
  args = _parse(argv)
  if args.worker:
    result = measure(args)
    if MPI.COMM_WORLD.rank == 0:
      print(json.dumps(result))
    return
  worker_argv = [a for a in argv if a != "--worker"]
  result = relaunch("checks", [*worker_argv, "--worker"], ranks=args.ranks, bind=args.bind)
  result.update(benchmark="checks", model="SmallCNN on digits, adam",
                batch_per_rank=args.batch_per_rank, steps_per_round=args.steps,
                rounds=args.rounds, launch=f"mpirun --bind-to {args.bind} -n {args.ranks}",
                jax=jax.__version__)
  sec, over = result["seconds_per_step"], result["overhead"]
  print(f"{args.ranks} ranks, digits CNN step, {args.batch_per_rank} images/rank:")
  for name, seconds in sec.items():
    extra = f"  overhead {over[name]:+.2%}" if name in over else ""
    print(f"  {name:16s} {seconds * 1e3:7.3f} ms/step{extra}")
  print(f"  check_replicas   {result['check_replicas_seconds'] * 1e3:7.3f} ms per call,"
        f" {result['check_replicas_overhead_per_digits_epoch']:+.2%} of a digits epoch's"
        f" {STEPS_PER_DIGITS_EPOCH} steps (goal for all default checks: < 1%)")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=2))
  print(f"results in {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
