"""What data parallelism costs a train step, measured side by side in one run.

    python -m lab.bench step                 # both parts; prints a table, writes JSON
    python -m lab.bench step --ranks 0       # only the size-1 overhead part

1. **Overhead on a size-1 communicator**: the digits CNN train step with
   ``optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))`` vs the plain
   ``optax.adam(1e-3)`` step, in this process. Goal: ratio <= 1.05.
2. **Communication efficiency at 2 ranks**: the script re-launches itself under
   ``mpirun -n 2``; both ranks alternate rounds of the step with `allreduce_gradients` and
   of the same step with no communication. Efficiency = throughput with allreduce /
   throughput without. Goal: >= 0.97. The naive baseline (``mpi4jax.allreduce`` with its
   ordered effect, on a concatenated buffer) runs in the same rounds. Ranks are bound to
   cores (``--bind-to core``, as on a cluster): unbound, the two ranks' threads migrate
   between the two cores and a rank that waits in MPI steals time from the one still
   computing (measured 0.80-0.86 unbound vs 0.92-1.0 bound on the same 2-core machine).
   Also in the same rounds: the 16-bit wire, 64 kB buckets, double buffering, the
   first bucket leaving as soon as its own leaves are ready (the default,
   `mnjax.comm._instep._allreduce.leaves_early`) against the other variants' buckets, which
   wait for every leaf (the CPU's default until the exchange ran in two halves),
   and the allreduce step with `mnjax.guard.Timeline` recording (its step traced with the
   timeline's tags and step marks, ``timeline.step`` called per step as the train loop
   does): ``timeline_overhead`` = its time / the allreduce step's. Goal: <= 1.03.
   And the exact sum (``create_communicator("flat", replicas=P)``: integer limbs, the same
   bits on any number of processes): ``exact_overhead`` = its time / the allreduce step's.
   Goal: <= 1.3.

Rounds alternate between the variants so that machine noise hits both alike; each round's
time is the slowest rank's (the job moves at the pace of its slowest replica), and the
median over rounds is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
import optax
from mpi4py import MPI

import mnjax
from lab.bench.launch import relaunch
from lab.bench.rounds import time_rounds
from lab.models import SmallCNN
from lab.runner import create_train_state, train_step
from mnjax.comm._instep import _allreduce as collectives


def _parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m lab.bench step", description=__doc__.split("\n")[0])
  p.add_argument("--batch_per_rank", type=int, default=32, help="examples per rank per step")
  p.add_argument("--steps", type=int, default=50, help="steps per timed round")
  p.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
  p.add_argument("--ranks", type=int, default=2, help="ranks for part 2 (0: skip it)")
  p.add_argument("--bind", default="core", help="mpirun --bind-to for part 2 (none: off)")
  p.add_argument("--out", default="runs/bench/step.json", help="JSON results")
  p.add_argument("--timeline", default="runs/bench/step_timeline.json",
                 help="the trace of the timeline variant's rounds")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


@contextlib.contextmanager
def _recording(timeline: mnjax.guard.Timeline):
  """The timeline's recording on for the block only (it traces and runs its own variant)."""
  timeline.resume()
  try:
    yield
  finally:
    timeline.pause()  # after the round's last result: every step's events are collected


def _time_variants(variants: dict, comm: mnjax.Communicator, args,
                   timeline: mnjax.guard.Timeline | None = None) -> dict[str, float]:
  """Median over rounds of the slowest rank's seconds per step, per variant (a variant
  named ``*timeline*`` traced and run with `timeline` recording)."""
  data = mnjax.data.load_digits("train")
  images = jnp.asarray(data.images[: args.batch_per_rank])
  labels = jnp.asarray(data.labels[: args.batch_per_rank])
  states = {}
  for name, tx in variants.items():
    state = create_train_state(SmallCNN(), tx, images[:1], jax.random.key(0))
    # Only the "leaving early" variant's buckets leave when ready (`leaves_early`).
    early = collectives.buckets_leave_early("leaving_early" in name)
    with early, (_recording(timeline) if "timeline" in name else contextlib.nullcontext()):
      for _ in range(3):  # compile and warm up
        state, _ = train_step(state, images, labels)
    states[name] = jax.block_until_ready(state)
  step = lambda state: train_step(state, images, labels)[0]  # noqa: E731
  runs, around = dict.fromkeys(states, step), {}
  for name in states:
    if "timeline" in name:
      counter = itertools.count()
      def marked(state, counter=counter):
        timeline.step(next(counter))  # the host's per-step call, as in the train loop
        return step(state)
      runs[name], around[name] = marked, functools.partial(_recording, timeline)
  return time_rounds(states, runs, comm.mpi_comm, rounds=args.rounds, steps=args.steps,
                     around=around)


def size_one_overhead(args) -> dict:
  comm = mnjax.create_communicator("flat", MPI.COMM_SELF)
  sec = _time_variants(
      {
          "plain_optax": optax.adam(1e-3),
          "mnjax_size1": optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3)),
      },
      comm,
      args,
  )
  return {
      "seconds_per_step": sec,
      "ratio_mnjax_over_plain": sec["mnjax_size1"] / sec["plain_optax"],
  }


def naive_mpi4jax_allreduce(comm: mnjax.Communicator) -> optax.GradientTransformation:
  """The baseline mnjax replaces: ``mpi4jax.allreduce`` (ordered effect) on a concatenation."""

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    flat = jnp.concatenate([leaf.ravel() for leaf in leaves])
    flat = mpi4jax.allreduce(flat, op=MPI.SUM, comm=comm.device_comm) / comm.size
    return treedef.unflatten(mnjax.comm._instep._buckets.unpack(flat, leaves)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def communication_efficiency(args) -> dict:
  comm = mnjax.create_communicator("flat")
  exact = mnjax.create_communicator("flat", replicas=comm.size)
  timeline = mnjax.guard.Timeline(comm, args.timeline, verbose=False)
  timeline.pause()  # on only while its variant is traced and timed
  sec = _time_variants(
      {
          "no_communication": optax.adam(1e-3),
          "allreduce": optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3)),
          "allreduce_bf16_wire": optax.chain(
              mnjax.allreduce_gradients(comm, wire_dtype=jnp.bfloat16), optax.adam(1e-3)),
          "allreduce_buckets_64kB": optax.chain(
              mnjax.allreduce_gradients(comm, bucket_bytes=64 << 10), optax.adam(1e-3)),
          "allreduce_leaving_early": optax.chain(
              mnjax.allreduce_gradients(comm), optax.adam(1e-3)),
          "allreduce_double_buffering": mnjax.create_multi_node_optimizer(
              optax.adam(1e-3), comm, double_buffering=True),
          "naive_mpi4jax": optax.chain(naive_mpi4jax_allreduce(comm), optax.adam(1e-3)),
          "allreduce_timeline": optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3)),
          "allreduce_exact": optax.chain(mnjax.allreduce_gradients(exact), optax.adam(1e-3)),
      },
      comm,
      args,
      timeline,
  )
  timeline.resume()
  report = timeline.close()  # rank 0 writes the trace of its variant's rounds
  images = comm.size * args.batch_per_rank
  return {
      "ranks": comm.size,
      "seconds_per_step": sec,
      "images_per_second": {k: images / v for k, v in sec.items()},
      "efficiency": sec["no_communication"] / sec["allreduce"],
      "efficiency_bf16_wire": sec["no_communication"] / sec["allreduce_bf16_wire"],
      "efficiency_buckets_64kB": sec["no_communication"] / sec["allreduce_buckets_64kB"],
      "efficiency_leaving_early": sec["no_communication"] / sec["allreduce_leaving_early"],
      "efficiency_double_buffering": (sec["no_communication"]
                                      / sec["allreduce_double_buffering"]),
      "efficiency_naive_mpi4jax": sec["no_communication"] / sec["naive_mpi4jax"],
      "timeline_overhead": sec["allreduce_timeline"] / sec["allreduce"],
      "exact_overhead": sec["allreduce_exact"] / sec["allreduce"],
      "timeline": args.timeline,
      "straggler_report": report,
  }


def main(argv: list[str]) -> None:
  args = _parse(argv)
  if args.worker:
    result = communication_efficiency(args)
    if MPI.COMM_WORLD.rank == 0:
      print(json.dumps(result))
    return

  results = {
      "benchmark": "step",
      "model": "SmallCNN on digits (8x8x1), adam",
      "batch_per_rank": args.batch_per_rank,
      "steps_per_round": args.steps,
      "rounds": args.rounds,
      "jax": jax.__version__,
      "devices": str(jax.devices()),
      "launch": f"mpirun --bind-to {args.bind} -n {args.ranks}",
      "params": int(sum(x.size for x in jax.tree.leaves(
          SmallCNN().init(jax.random.key(0), np.zeros((1, 8, 8, 1)))))),
  }
  results["size1"] = size_one_overhead(args)
  s1 = results["size1"]
  print(f"size-1 communicator: plain optax {s1['seconds_per_step']['plain_optax'] * 1e3:.3f}"
        f" ms/step, mnjax {s1['seconds_per_step']['mnjax_size1'] * 1e3:.3f} ms/step,"
        f" ratio {s1['ratio_mnjax_over_plain']:.3f} (goal <= 1.05)")
  if args.ranks:
    worker_argv = [a for a in argv if a != "--worker"]
    results["multi"] = multi = relaunch("step", [*worker_argv, "--worker"], ranks=args.ranks,
                                         bind=args.bind)
    ips = multi["images_per_second"]
    print(f"{multi['ranks']} ranks: no communication {ips['no_communication']:,.0f} img/s,"
          f" with allreduce {ips['allreduce']:,.0f} img/s, efficiency"
          f" {multi['efficiency']:.3f} (goal >= 0.97); naive mpi4jax"
          f" {ips['naive_mpi4jax']:,.0f} img/s, efficiency {multi['efficiency_naive_mpi4jax']:.3f};"
          f" bf16 wire {multi['efficiency_bf16_wire']:.3f}; 64 kB buckets"
          f" {multi['efficiency_buckets_64kB']:.3f}; first bucket leaving early"
          f" {multi['efficiency_leaving_early']:.3f}; double buffering"
          f" {multi['efficiency_double_buffering']:.3f}; timeline on / off"
          f" {multi['timeline_overhead']:.3f} (goal <= 1.03, trace in {multi['timeline']});"
          f" exact sums / allreduce {multi['exact_overhead']:.3f} (goal <= 1.3)")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=2))
  print(f"results in {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
