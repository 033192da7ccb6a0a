"""One job of ``python -m lab.bench cluster``'s step part: train steps timed across emulated
nodes, each variant against the same step with no cross-node exchange.

``python -m lab.bench.cluster_step_worker --kind flat --models cnn,resnet --variants
allreduce,double_buffering --out r.json`` under ``python -m lab.cluster run`` (or
``mpirun``). Models (`MODELS`): ``cnn``, the digits CNN (`lab.models.SmallCNN`, adam, 32
digits per device) and ``resnet``, a ResNet-10 (`lab.models.ResNet`, one `BasicBlock` per
stage, CIFAR stem, per-rank BatchNorm, momentum SGD) on synthetic 8x8 images, 4 per device
(``--resnet-images``):
4.9M parameters, small enough that at 1 Gbit/s its exchange, not its compute, is most of
the step. Variants (`VARIANTS`) are optax chains over the same step (``local_sgd8``: rounds
of whole multiples of 8 steps, so each holds its meetings; ``local_sgd_alone``: the same
transformation that never meets while timed); ``no_communication``
is always timed: plain optax (one device per rank) or gradients averaged over the
process's own devices only (several), as in ``python -m lab.bench kinds``. Rounds
alternate between variants (`lab.bench.rounds.time_rounds`: slowest rank, median).

The exchange rows (`EXCHANGE_ROWS`) are also timed from the in-step handlers' events
(`lab.bench.handler_time.exchange_seconds`: each collective from its last arrival to its
last completion; windows of 8 steps, local SGD's whole rounds). Rank 0 writes ``{"kind",
"ranks", "devices_per_rank", "models": {name: {"params", "grad_bytes", "bucket_bytes":
{variant: [wire bytes per bucket]}, "seconds_per_step": {variant: s}, "exchange_seconds":
{variant: s}}}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

NEVER = 1 << 30   # local SGD's every_k that no benchmark reaches
# name -> (allreduce_gradients options, buckets leave early): what each variant changes.
VARIANTS = {
    "allreduce": ({}, False),                          # plain: buckets after every leaf
    "allreduce_bf16_wire": ({"wire_dtype": "bfloat16"}, False),
    "buckets_backprop_order": ({}, True),              # the default: leave when ready
    "double_buffering": ({"double_buffering": True}, False),
    "local_sgd8": ({"local_sgd": 8}, False),           # mnjax.optim.local_sgd, every_k=8
    # The same transformation that never meets while timed: local SGD's own per-step work
    # (its state through lax.cond), the baseline of local_sgd8's exchange.
    "local_sgd_alone": ({"local_sgd": NEVER}, False),
}
MODELS = ("cnn", "resnet")
# Variants whose exchange nothing hides: the model's exchange time is a claim about them,
# timed from the handlers' events too (`lab.bench.handler_time`).
EXCHANGE_ROWS = ("allreduce", "allreduce_bf16_wire", "local_sgd8")


def _model(name: str, resnet_images: int = 4):
  """(flax module, optimizer, images per device, image shape) of a benchmark model."""
  import flax.linen as nn
  import optax

  from lab import models
  if name == "cnn":
    return models.SmallCNN(), optax.adam(1e-3), 32, (8, 8, 1)
  resnet10 = models.ResNet10(num_classes=10, stem="cifar", norm=nn.BatchNorm)
  return resnet10, optax.sgd(0.01, momentum=0.9), resnet_images, (8, 8, 3)


def _batch(name: str, comm, per_device: int, shape):
  import jax.numpy as jnp
  import numpy as np

  import mnjax
  n = per_device * comm.local_device_count
  if name == "cnn":
    data = mnjax.data.load_digits("train")
    first = comm.rank * n
    return jnp.asarray(data.images[first:first + n]), jnp.asarray(data.labels[first:first + n])
  rng = np.random.default_rng(comm.rank)
  return (jnp.asarray(rng.normal(size=(n, *shape)).astype(np.float32)),
          jnp.asarray(rng.integers(0, 10, n).astype(np.int32)))


def bucket_plan(model: str, variant: str) -> list[float]:
  """Wire bytes of each bucket `variant`'s exchange of `model`'s gradient sends: the plan
  `allreduce_gradients` uses on CPUs (`lab.costmodel.step.planned_buckets`), from shapes.

  Example:
    >>> len(bucket_plan("cnn", "allreduce")), sum(bucket_plan("cnn", "allreduce"))
    (3, 605224.0)
  """
  import jax
  import jax.numpy as jnp

  from lab.costmodel.step import planned_buckets
  from mnjax.comm._instep._buckets import DEFAULT_BUCKET_BYTES
  module, _, _, shape = _model(model)
  kwargs = {"train": False} if model == "resnet" else {}
  params = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, *shape)),
                                              **kwargs))["params"]
  wire = jnp.bfloat16 if "wire_dtype" in VARIANTS[variant][0] else None
  return planned_buckets(params, DEFAULT_BUCKET_BYTES["cpu"], wire_dtype=wire)


def _time_model(name: str, comm, variants: list[str], args) -> dict:
  import jax
  import optax

  import mnjax
  from lab.bench.handler_time import exchange_seconds
  from lab.bench.rounds import time_rounds
  from lab.runner import create_train_state, make_train_step
  from mnjax.comm._instep import _allreduce as collectives

  module, opt, per_device, shape = _model(name, args.resnet_images)
  images, labels = _batch(name, comm, per_device, shape)
  local = (None if not comm.multi_device else
           dataclasses.replace(comm, kind="single_node", size=1))   # this process's devices
  chains = {"no_communication": opt if local is None else
            optax.chain(mnjax.allreduce_gradients(local), opt)}
  plans = {}
  for v in variants:
    options = dict(VARIANTS[v][0])
    if "wire_dtype" in options:
      options["wire_dtype"] = jax.numpy.dtype(options["wire_dtype"])
    every_k = options.pop("local_sgd", None)
    chains[v] = (mnjax.optim.local_sgd(opt, comm, every_k=every_k, **options) if every_k
                 else mnjax.create_multi_node_optimizer(opt, comm, **options))
  states, steps = {}, {}
  for v, tx in chains.items():
    step = make_train_step(local if v == "no_communication" and local else comm)
    early = collectives.buckets_leave_early(VARIANTS.get(v, ({}, False))[1])
    # Jitted init: eager init runs (and compiles) ResNet's ops one by one.
    state = jax.jit(functools.partial(create_train_state, module, tx, images[:1],
                                      jax.random.key(0)))()
    with early:
      for _ in range(2):   # compile (inside the block: the bucket timing is traced), warm up
        state, _ = step(state, images, labels)
    states[v], steps[v] = jax.block_until_ready(state), step
    if v != "no_communication":
      plans[v] = bucket_plan(name, v)
  runs = {v: functools.partial(lambda s, step: step(s, images, labels)[0], step=steps[v])
          for v in states}
  steps = args.cnn_steps if name == "cnn" else args.steps
  rounds_of = [VARIANTS[v][0].get("local_sgd", 1) for v in variants
               if VARIANTS[v][0].get("local_sgd") != NEVER]
  period = max(rounds_of, default=1)
  steps = -(-steps // period) * period  # local SGD: whole rounds, one meeting per round
  seconds = time_rounds(states, runs, comm.mpi_comm, rounds=args.rounds, steps=steps)
  # The exchange rows' exchange, from the handlers' own events (the model's claim).
  exchange = {}
  for v in (v for v in variants if v in EXCHANGE_ROWS):
    every_k = VARIANTS[v][0].get("local_sgd", 1)
    exchange[v], _, _ = exchange_seconds(states[v], runs[v], comm.mpi_comm, windows=args.rounds,
                                      steps=every_k * -(-min(steps, 8) // every_k))
  n = sum(x.size for x in jax.tree.leaves(states["no_communication"].params))
  return {"params": int(n), "grad_bytes": 4 * int(n), "images_per_device": per_device,
          "bucket_bytes": plans, "seconds_per_step": seconds, "exchange_seconds": exchange}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m lab.bench.cluster_step_worker")
  p.add_argument("--kind", default="flat", choices=("flat", "hierarchical", "two_dimensional"))
  p.add_argument("--models", default="cnn,resnet", help=f"comma-separated: {', '.join(MODELS)}")
  p.add_argument("--variants", default="allreduce",
                 help=f"comma-separated: {', '.join(VARIANTS)} (no_communication: always)")
  p.add_argument("--steps", type=int, default=3, help="ResNet steps per timed round")
  p.add_argument("--cnn-steps", type=int, default=20, help="digits CNN steps per timed round")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds per variant")
  p.add_argument("--resnet-images", type=int, default=4,
                 help="ResNet images per device (more: more compute for the same exchange)")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  models, variants = args.models.split(","), args.variants.split(",")
  if not set(models) <= set(MODELS) or not set(variants) <= set(VARIANTS):
    raise SystemExit(f"--models: {', '.join(MODELS)}; --variants: {', '.join(VARIANTS)};"
                     f" got {args.models!r}, {args.variants!r}")

  import mnjax
  comm = mnjax.create_communicator(args.kind)
  result = {"kind": args.kind, "ranks": comm.size, "devices_per_rank": comm.local_device_count,
            "steps": args.steps, "rounds": args.rounds,
            "models": {m: _time_model(m, comm, variants, args) for m in models}}
  if comm.rank == 0:
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"cluster_step_worker: {json.dumps(result)[:2000]}", flush=True)


if __name__ == "__main__":
  main()
