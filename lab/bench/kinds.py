"""Communicator kinds side by side on several devices per process (emulated nodes).

    python -m lab.bench kinds                # 2 processes x 2 emulated devices
    python -m lab.bench kinds --ranks 3 --devices 2

Re-launches itself twice under ``mpirun --bind-to core -n RANKS`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=DEVICES`` (once for the MPI kinds, once
for ``xla``: see GROUPS). For each kind it measures, in alternating rounds:

* the gradient reduction alone (`mnjax.comm.allreduce_tree` inside
  `mnjax.data_parallel`), in microseconds, for the digits CNN's gradient tree (151k float32)
  and for a ResNet-50-sized gradient (25.6M float32, 102 MB);
* the digits CNN train step, as efficiency = step time with no cross-process traffic
  (gradients averaged over the local devices only) / step time with the kind.

``xla`` is JAX's own path (jax.distributed, a global mesh, gloo collectives on CPU); its
step also pays for turning the process's arrays into global ones and back on every call.

Each round's time is the slowest rank's; medians over rounds are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

# Two launches: starting jax.distributed (for xla) switches *all* of a process's CPU
# collectives to gloo, local psums included (measured: the local-only step went from 12.6 to
# 30 ms), so the MPI kinds are measured in processes without it. Each launch has its own
# local-only baseline.
GROUPS = {"mpi": ("hierarchical", "two_dimensional"), "xla": ("xla",)}


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m lab.bench kinds",
                              description=__doc__.split("\n")[0])
  p.add_argument("--ranks", type=int, default=2)
  p.add_argument("--devices", type=int, default=2, help="emulated devices per process")
  p.add_argument("--batch_per_device", type=int, default=32)
  p.add_argument("--steps", type=int, default=20, help="steps per timed round")
  p.add_argument("--rounds", type=int, default=9)
  p.add_argument("--big_calls", type=int, default=2, help="ResNet-50-sized reductions per round")
  p.add_argument("--out", default="runs/bench/kinds.json")
  p.add_argument("--worker", choices=tuple(GROUPS), help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _worker(args) -> dict | None:
  import mnjax

  kinds = GROUPS[args.worker]
  if args.worker == "xla":  # first: jax.distributed must start before JAX is used
    xla = mnjax.create_communicator("xla")
  import jax
  import optax
  from mpi4py import MPI

  from lab.models import SmallCNN
  from lab.runner import create_train_state, make_train_step

  data = mnjax.data.load_digits("train")
  comms = {"xla": xla} if args.worker == "xla" else {k: mnjax.create_communicator(k) for k in kinds}
  # The baseline: the same mapped step, gradients averaged over local devices only.
  some = comms[kinds[0]]
  local_only = dataclasses.replace(
      mnjax.create_communicator("hierarchical") if args.worker == "xla" else some,
      kind="single_node", size=1)
  variants = {"local_only": local_only, **comms}
  per_process = args.batch_per_device * some.local_device_count
  images = data.images[:per_process]
  labels = data.labels[:per_process]
  host = some.mpi_comm

  def timed(fn, arg, chain: bool, calls: int):
    """Slowest rank's seconds per call; `chain` feeds each output into the next call."""
    host.Barrier()
    start = time.perf_counter()
    out = arg
    for _ in range(calls):
      out = fn(out if chain else arg)
    jax.block_until_ready(out)
    return host.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX), out

  reducers, steps, states = {}, {}, {}
  grads = SmallCNN().init(jax.random.key(0), images[:1])["params"]
  resnet50 = {"grads": jax.numpy.ones((25_600_000,), jax.numpy.float32)}
  for name, kc in variants.items():
    reducers[name] = mnjax.data_parallel(
        lambda g, kc=kc: mnjax.comm.allreduce_tree(g, kc), kc, batch_argnums=())
    tx = optax.chain(mnjax.allreduce_gradients(kc), optax.adam(1e-3))
    states[name] = create_train_state(SmallCNN(), tx, images[:1], jax.random.key(0))
    step = make_train_step(kc)
    steps[name] = lambda state, step=step: step(state, images, labels)[0]
    jax.block_until_ready(reducers[name](resnet50))  # compile, warm up
    for _ in range(3):
      jax.block_until_ready(reducers[name](grads))
      states[name] = jax.block_until_ready(steps[name](states[name]))

  reduce_s = {name: [] for name in variants}
  big_s = {name: [] for name in variants}
  step_s = {name: [] for name in variants}
  for _ in range(args.rounds):
    for name in variants:
      seconds, _ = timed(reducers[name], grads, chain=False, calls=args.steps)
      reduce_s[name].append(seconds)
      seconds, _ = timed(reducers[name], resnet50, chain=False, calls=args.big_calls)
      big_s[name].append(seconds)
      seconds, states[name] = timed(steps[name], states[name], chain=True, calls=args.steps)
      step_s[name].append(seconds)
  reduce_med = {k: statistics.median(v) for k, v in reduce_s.items()}
  step_med = {k: statistics.median(v) for k, v in step_s.items()}
  if host.rank != 0:
    return None
  return {
      "processes": some.size,
      "devices_per_process": some.local_device_count,
      "batch_per_device": args.batch_per_device,
      "reduce_us": {k: v * 1e6 for k, v in reduce_med.items()},
      "reduce_resnet50_ms": {k: statistics.median(v) * 1e3 for k, v in big_s.items()},
      "step_ms": {k: v * 1e3 for k, v in step_med.items()},
      "efficiency": {k: step_med["local_only"] / step_med[k] for k in kinds},
  }


def main(argv):
  args = _parse(argv)
  if args.worker:
    result = _worker(args)
    if result is not None:
      print(json.dumps(result))
    return
  from lab.bench.launch import emulated_devices_env, relaunch

  env = emulated_devices_env(args.devices)
  results = {group: relaunch("kinds", [*argv, "--worker", group], ranks=args.ranks, env=env)
             for group in GROUPS}
  first = results["mpi"]
  print(f"{first['processes']} processes x {first['devices_per_process']} devices,"
        f" {first['batch_per_device']} images per device")
  print(f"{'launch':6s} {'kind':16s} {'CNN reduce (us)':>16s} {'R50 reduce (ms)':>16s}"
        f" {'step (ms)':>10s} {'efficiency':>11s}")
  for group, result in results.items():
    for kind in ("local_only", *GROUPS[group]):
      eff = result["efficiency"].get(kind, 1.0)
      print(f"{group:6s} {kind:16s} {result['reduce_us'][kind]:16.0f}"
            f" {result['reduce_resnet50_ms'][kind]:16.1f} {result['step_ms'][kind]:10.2f}"
            f" {eff:11.3f}")
  xla = results["xla"]
  for kind in GROUPS["mpi"]:
    print(f"{kind} / xla reduction time: CNN"
          f" {results['mpi']['reduce_us'][kind] / xla['reduce_us']['xla']:.2f}x, ResNet-50"
          f" {results['mpi']['reduce_resnet50_ms'][kind] / xla['reduce_resnet50_ms']['xla']:.2f}x")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=2))
  print(f"results in {args.out}")
