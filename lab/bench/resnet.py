"""ResNet-50 training throughput on synthetic data, at 1 and 2 ranks, side by side.

    python -m lab.bench resnet                          # ResNet-50, 64 px, 8 images/rank
    python -m lab.bench resnet --model resnet18 --image_size 32

Two launches under ``mpirun --bind-to core`` (one core per rank, as one GPU per rank on a
cluster), each timing its variants in alternating rounds (median over rounds of the slowest
rank's step time):

* 1 rank: ``plain`` (flax ``nn.BatchNorm`` + optax momentum SGD, no mnjax) and ``mnjax``
  (`SyncBatchNorm` + ``allreduce_gradients`` on a size-1 communicator): the overhead ratio.
* 2 ranks: ``allreduce`` (SyncBatchNorm + flat ``allreduce_gradients``, the experiment's
  default), ``allreduce_local_bn`` (per-rank BN, ChainerMN's default),
  ``double_buffering_local_bn`` (the same with ``double_buffering=True``: the exchange reads
  only the optimizer state, free to overlap the step) and ``no_communication`` (the same
  step without any collective). The communication share of the step is
  ``1 - t(no_communication) / t(allreduce)``; weak-scaling efficiency is
  ``images/s at 2 ranks / (2 x images/s at 1 rank)``.

The batch is a fixed device-resident synthetic ImageNet batch: this measures the step, not
the input pipeline (experiments/imagenet.py reports the loader's wait share).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import mnjax
from lab import models
from lab.bench.launch import relaunch
from lab.bench.rounds import time_rounds
from lab.runner import create_train_state, make_train_step

MODELS = {"resnet6": models.ResNet6, "resnet10": models.ResNet10, "resnet18": models.ResNet18,
          "resnet50": models.ResNet50}


def parse_args(argv: list[str]) -> argparse.Namespace:
  """The benchmark's options (``python -m lab.bench resnet --help``)."""
  p = argparse.ArgumentParser(prog="python -m lab.bench resnet",
                              description=__doc__.split("\n")[0])
  p.add_argument("--model", choices=sorted(MODELS), default="resnet50")
  p.add_argument("--image_size", type=int, default=64)
  p.add_argument("--batch_per_rank", type=int, default=8)
  p.add_argument("--steps", type=int, default=3, help="steps per timed round")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds per variant")
  p.add_argument("--bind", default="core", help="mpirun --bind-to (none: off)")
  p.add_argument("--share_devices", type=int, default=0,
                 help="1: ranks may share a GPU (create_communicator(share_devices=True))")
  p.add_argument("--out", default="runs/bench/resnet.json", help="JSON results")
  p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _variants(ranks: int, comm: mnjax.Communicator) -> dict:
  """name -> (norm layer, optax chain)."""
  sgd = optax.sgd(0.01, momentum=0.9)
  synced = functools.partial(mnjax.SyncBatchNorm, comm)
  allreduce = mnjax.allreduce_gradients(comm)
  if ranks == 1:
    return {"plain": (nn.BatchNorm, sgd), "mnjax": (synced, optax.chain(allreduce, sgd))}
  return {"allreduce": (synced, optax.chain(allreduce, sgd)),
          "allreduce_local_bn": (nn.BatchNorm, optax.chain(allreduce, sgd)),
          # per-rank BN: no other in-step collective, the exchange is free to overlap
          "double_buffering_local_bn": (nn.BatchNorm, mnjax.create_multi_node_optimizer(
              sgd, comm, double_buffering=True)),
          "no_communication": (nn.BatchNorm, sgd)}


def _worker(args) -> dict:
  comm = mnjax.create_communicator("flat", share_devices=bool(args.share_devices))
  rng = np.random.default_rng(comm.rank)
  shape = (args.batch_per_rank, args.image_size, args.image_size, 3)
  images = jnp.asarray(rng.normal(size=shape).astype(np.float32))
  labels = jnp.asarray(rng.integers(0, 1000, args.batch_per_rank).astype(np.int32))
  step = make_train_step(comm)
  states = {}
  for name, (norm, tx) in _variants(comm.size, comm).items():
    model = MODELS[args.model](num_classes=1000, norm=norm)
    # Jitted: eager init runs (and compiles) ResNet's ops one by one, 3-5x slower.
    state = jax.jit(functools.partial(create_train_state, model, tx, images[:1],
                                      jax.random.key(0)))()
    for _ in range(2):  # compile, warm up
      state, _ = step(state, images, labels)
    states[name] = jax.block_until_ready(state)
  return time_rounds(states, lambda state: step(state, images, labels)[0], comm.mpi_comm,
                     rounds=args.rounds, steps=args.steps)


def launch(args: argparse.Namespace, ranks: int, *, timeout: float = 1800) -> dict[str, float]:
  """Seconds per step of each variant at `ranks` (1 or 2) ranks: one mpirun launch.

  Example:
    >>> launch(parse_args(["--model", "resnet18"]), 2)  # doctest: +SKIP
    {'allreduce': 0.41, 'allreduce_local_bn': 0.39, 'no_communication': 0.33}
  """
  common = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "out", "bind")]
  return relaunch("resnet", common + [f"--worker={ranks}"], ranks=ranks, bind=args.bind,
                  timeout=timeout)


def summarize(args: argparse.Namespace, one: dict[str, float], two: dict[str, float]) -> dict:
  """The benchmark's figures from the 1-rank and 2-rank seconds per step (`launch`).

  Example:
    >>> one = {"plain": 0.30, "mnjax": 0.31}      # seconds per step, from launch(args, 1)
    >>> two = {"allreduce": 0.40, "allreduce_local_bn": 0.38, "no_communication": 0.33}
    >>> round(summarize(parse_args([]), one, two)["weak_scaling_efficiency"], 3)
    0.775
  """
  ips = lambda seconds, ranks: ranks * args.batch_per_rank / seconds  # noqa: E731
  return {
      "config": {k: v for k, v in vars(args).items() if k != "worker"},
      "seconds_per_step": {"1_rank": one, "2_ranks": two},
      "images_per_second": {**{f"1_rank_{k}": ips(v, 1) for k, v in one.items()},
                            **{f"2_ranks_{k}": ips(v, 2) for k, v in two.items()}},
      "overhead_size1": one["mnjax"] / one["plain"],
      "communication_share": 1 - two["no_communication"] / two["allreduce"],
      "communication_efficiency": two["no_communication"] / two["allreduce"],
      "local_bn_efficiency": two["no_communication"] / two["allreduce_local_bn"],
      **({"double_buffering_efficiency":
          two["no_communication"] / two["double_buffering_local_bn"]}
         if "double_buffering_local_bn" in two else {}),
      "weak_scaling_efficiency": ips(two["allreduce"], 2) / (2 * ips(one["mnjax"], 1)),
  }


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  if args.worker:
    seconds = _worker(args)
    if MPI.COMM_WORLD.rank == 0:
      print(json.dumps(seconds), flush=True)
    return
  load = [os.getloadavg()[0]]  # this machine's other jobs skew every figure: say how much
  one = launch(args, 1)
  load.append(os.getloadavg()[0])
  two = launch(args, 2)
  load.append(os.getloadavg()[0])
  result = {**summarize(args, one, two), "load_average_1min": [round(x, 2) for x in load]}
  print(f"{args.model} at {args.image_size} px, {args.batch_per_rank} images/rank/step"
        f" (median of {args.rounds} rounds x {args.steps} steps, --bind-to {args.bind})")
  for name, value in result["images_per_second"].items():
    print(f"  {name:28s} {value:8.2f} img/s")
  for key in ("overhead_size1", "communication_share", "communication_efficiency",
              "local_bn_efficiency", "weak_scaling_efficiency"):
    print(f"  {key:28s} {result[key]:8.3f}")
  print(f"  {'load average (1 min)':28s} {' -> '.join(f'{x:.1f}' for x in load)}"
        " (start, after 1 rank, after 2 ranks)")
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2))
  print(json.dumps(result), file=sys.stderr)


if __name__ == "__main__":
  main(sys.argv[1:])
