"""The ChainerMN experiment: ResNet on ImageNet (or CIFAR-10, MNIST, digits, synthetic data).

Configs (``--config``; any flag overrides a field):

* ``imagenet``: ResNet-50, ImageNet-1k at 224 px, 32 images per replica (ChainerMN,
  Goyal et al.), Goyal's schedule (lr 0.1 x global/256, 5 warmup epochs, /10 at 30/60/80),
  synchronized BN, 90 epochs. On a Slurm cluster with the data prepared once
  (``tfds build imagenet2012 --data_dir /shared/tfds --file_format array_record``)::

      srun -N 32 --ntasks-per-node 4 python experiments/imagenet.py --config imagenet \\
          --data_dir /shared/tfds --global_batch_size 4096 --workdir runs/r50

  Expected time: not measured here (no GPU was lent to this project); ChainerMN reports
  4.4 hours for 90 epochs on 128 P100s.
* ``cifar10``: ResNet-18 with the CIFAR stem, 128 per step, 30 epochs::

      mpirun -n 2 python experiments/imagenet.py --config cifar10 --data_dir ~/tensorflow_datasets

  Expected time: a GPU run. On this project's 2-core CPU machine ResNet-18 at 32 px trains
  at 8.6 img/s on 2 ranks (measured on mocked CIFAR-10), about 1.6 hours per epoch.
* ``synthetic``: ResNet-50 on random ImageNet-shaped images, for throughput (no data)::

      mpirun -n 2 python experiments/imagenet.py --config synthetic --image_size 64 \\
          --steps_per_epoch 5 --epochs 2 --baseline_workdir runs/synthetic-1rank

  Expected time: 2-3 minutes on 2 CPU cores (ResNet-50 at 64 px steps at 8.3 img/s on 2
  ranks, `python -m mnjax.bench resnet`, plus about a minute of compilation).
* ``digits`` (the default; offline): ResNet-18 (CIFAR stem) on the 8x8 UCI digits:
  ``mpirun -n 2 python experiments/imagenet.py``. Measured in one process on 2 CPU cores:
  ~19 s per epoch, 96% test top-1 after 3 epochs (10 by default).

Rank 0 prints per epoch: loss, top-1 (train and test), images/s per rank and in total,
epoch time, the share of time the loop waited for input, and with ``--baseline_workdir``
(the same config run with 1 rank) the parallel efficiency. The work directory gets
``config.json``, ``metrics.jsonl`` and ``checkpoints/`` (orbax, every ``--checkpoint_every``
epochs and ``--checkpoint_steps`` steps: parameters, batch statistics, optimizer state and
the data position). A killed run continues exactly where its newest checkpoint left off with
``--resume``; the fail-fast checks of the digits job (abort on error, stall watchdog,
non-finite step skipping, replica comparison after each epoch) are on here too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import mnjax
from mnjax import models
from mnjax.data import augment
from mnjax.train import _bn_classifier as bn_classifier
from mnjax.optim import recipes
from mnjax.data import _sources as sources
from mnjax.data import Loader


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that defines a run; written to ``config.json``."""

  dataset: str = "digits"
  data_dir: str = ""
  model: str = "resnet18"
  stem: str = "cifar"
  image_size: int = 0  # imagenet2012/synthetic side (0: 224)
  comm: str = "auto"  # a kind of mnjax.KINDS; auto: xla on GPUs, flat on CPUs
  sync_bn: bool = True
  bn_momentum: float = 0.9  # 0.0: evaluate with the last global minibatch's statistics
  optimizer: str = "goyal"  # goyal | lars | rmsprop_warmup
  base_lr: float = 0.1  # per 256 examples (linear scaling)
  warmup_epochs: float = 5.0
  label_smoothing: float = 0.0
  wire_dtype: str = "float32"
  bucket_mb: str = "auto"  # largest fused gradient buffer in MiB; auto: the platform default; 0: one buffer per dtype
  epochs: int = 10
  steps_per_epoch: int = 0  # 0: the whole split; else at most this many steps per epoch
  global_batch_size: int = 64
  seed: int = 0
  workdir: str = "runs/resnet-digits"
  checkpoint_every: int = 1  # epochs between checkpoints (<workdir>/checkpoints); 0: never
  checkpoint_steps: int = 0  # also every N steps; 0: at epoch ends only
  keep_checkpoints: int = 3
  resume: bool = False  # continue from the newest intact checkpoint
  max_consecutive_skips: int = 10  # steps with NaN/Inf gradients skipped in a row before failing
  stall_timeout: float = 300.0  # watchdog: seconds ranks may drift apart; 0 disables it
  baseline_workdir: str = ""  # a 1-rank run of the same config, for parallel efficiency
  eval: bool = True

# Fields that fix the data order and the optimizer: a resumed run must keep them.
# Reading the skip counter waits for a step: every 10 steps it costs nothing measurable.
DIVERGENCE_CHECK_EVERY = 10
# The train step's metric sums, zero (checkpoints hold an epoch's partial sums).
ZERO_SUMS = {"loss_sum": np.float32(0), "correct": np.int32(0), "count": np.int32(0)}
RESUME_SETTINGS = ("dataset", "model", "global_batch_size", "optimizer", "base_lr",
                   "warmup_epochs", "seed", "steps_per_epoch", "image_size")

CONFIGS = {
    "digits": Config(),
    "cifar10": Config(dataset="cifar10", epochs=30, global_batch_size=128,
                      workdir="runs/resnet18-cifar10"),
    "imagenet": Config(dataset="imagenet2012", model="resnet50", stem="imagenet",
                       epochs=90, global_batch_size=256, label_smoothing=0.1,
                       workdir="runs/resnet50-imagenet"),
    "synthetic": Config(dataset="synthetic", model="resnet50", stem="imagenet", epochs=2,
                        steps_per_epoch=10, global_batch_size=32, eval=False,
                        workdir="runs/resnet50-synthetic"),
}
MODELS = {"resnet18": models.ResNet18, "resnet34": models.ResNet34, "resnet50": models.ResNet50,
          "resnet101": models.ResNet101, "resnet152": models.ResNet152}


def parse_args(argv: list[str] | None = None) -> Config:
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--config", choices=sorted(CONFIGS), default="digits")
  known, rest = pre.parse_known_args(argv)
  base = CONFIGS[known.config]
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[pre])
  for field in dataclasses.fields(Config):
    default = getattr(base, field.name)
    if field.type == "bool":
      parser.add_argument(f"--{field.name}", action=argparse.BooleanOptionalAction,
                          default=default)
    else:
      kind = {"int": int, "float": float, "str": str}[field.type]
      parser.add_argument(f"--{field.name}", type=kind, default=default)
  args = vars(parser.parse_args(argv))
  args.pop("config")
  config = Config(**args)
  if config.model not in MODELS:
    parser.error(f"--model must be one of {sorted(MODELS)}, got {config.model!r}")
  if config.optimizer not in ("goyal", "lars", "rmsprop_warmup"):
    parser.error(f"--optimizer must be goyal, lars or rmsprop_warmup, got {config.optimizer!r}")
  return config


def optimizer(config: Config, steps_per_epoch: int) -> optax.GradientTransformation:
  schedule = recipes.goyal_schedule(
      config.global_batch_size, steps_per_epoch, base_lr=config.base_lr,
      warmup_epochs=config.warmup_epochs)
  if config.optimizer == "lars":
    return recipes.lars(schedule)
  if config.optimizer == "rmsprop_warmup":
    blend = recipes.blend_schedule(steps_per_epoch, 0.0, max(config.warmup_epochs, 1e-3))
    return optax.chain(optax.add_decayed_weights(1e-4, recipes.decay_mask),
                       recipes.rmsprop_warmup(schedule, blend))
  return recipes.goyal_sgd(config.global_batch_size, steps_per_epoch, base_lr=config.base_lr,
                           warmup_epochs=config.warmup_epochs)


def baseline_rate(workdir: str) -> float | None:
  """Images/s per rank in the last epoch of a 1-rank run of the same config."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not workdir or not os.path.exists(path):
    return None
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return records[-1]["images_per_second_per_rank"] if records else None


def train_and_evaluate(config: Config, comm: mnjax.Communicator):
  """Trains for ``config.epochs``; returns the final state and the last epoch's record."""
  per_process = mnjax.local_batch_size(config.global_batch_size, comm)  # fails on every rank
  data_dir = config.data_dir or None
  open_split = functools.partial(sources.open_source, config.dataset, data_dir=data_dir,
                                 image_size=config.image_size or 224, seed=config.seed)
  train_source = open_split("train")
  train_fn, eval_fn = augment.transforms(config.dataset, config.image_size or None)
  train_loader = Loader(train_source, comm, per_process, train_fn, train=True, seed=config.seed)
  test_loader = (Loader(open_split("test"), comm, per_process, eval_fn, train=False)
                 if config.eval else None)
  steps = train_loader.steps()
  if config.steps_per_epoch:
    steps = min(steps, config.steps_per_epoch)

  norm = functools.partial(mnjax.SyncBatchNorm, comm) if config.sync_bn else nn.BatchNorm
  model = MODELS[config.model](num_classes=train_source.num_classes, stem=config.stem, norm=norm,
                               bn_momentum=config.bn_momentum)
  bucket = mnjax.comm.bucket_bytes_from_mb(config.bucket_mb)
  # After the allreduce every rank holds the same gradient, so all skip a NaN step together.
  tx = optax.chain(
      mnjax.allreduce_gradients(comm, wire_dtype=config.wire_dtype, bucket_bytes=bucket),
      mnjax.skip_nonfinite(optimizer(config, steps)))
  sample = eval_fn(train_source[0][0], None)[None]  # one preprocessed image: the input shape
  state = bn_classifier.create_state(model, tx, sample, jax.random.key(config.seed))
  state = mnjax.broadcast(state, comm, root=0)
  train_step = bn_classifier.make_train_step(comm, label_smoothing=config.label_smoothing)

  checkpoints = mnjax.LoopCheckpoints(
      os.path.join(config.workdir, "checkpoints"), comm, resume=config.resume,
      keep=config.keep_checkpoints, settings={k: getattr(config, k) for k in RESUME_SETTINGS})
  state, sums, first_epoch, first_batch = checkpoints.start(state, ZERO_SUMS)
  step = int(state.step)

  mnjax.train.write_config(config.workdir, config, comm)
  log = mnjax.train.MetricsLog(config.workdir, comm)
  baseline = baseline_rate(config.baseline_workdir)
  if comm.is_root:
    print(f"mnjax: {config.model} on {config.dataset} ({len(train_source)} train examples),"
          f" {comm.summary}{' (--comm auto)' if config.comm == 'auto' else ''},"
          f" global batch {config.global_batch_size}, {steps} steps/epoch,"
          f" {'synchronized' if config.sync_bn else 'per-replica'} BN"
          + (f"; resuming at epoch {first_epoch}, batch {first_batch} (step {step})"
             if step else ""), flush=True)

  record: dict = {}
  watchdog = mnjax.Watchdog(comm, timeout=config.stall_timeout) if config.stall_timeout else None
  with contextlib.ExitStack() as stack:
    stack.callback(checkpoints.close)
    if watchdog is not None:
      stack.enter_context(watchdog)
    for epoch in range(first_epoch, config.epochs + 1):
      begin = first_batch if epoch == first_epoch else 0
      waited = train_loader.wait_seconds
      start = time.perf_counter()
      for i, batch in enumerate(train_loader.epoch(epoch, start=min(begin, steps)), start=begin):
        if i >= steps:
          break
        if watchdog is not None:
          watchdog.step(step)
        previous = state
        state, metrics = train_step(state, batch.images, batch.labels)
        if step % DIVERGENCE_CHECK_EVERY == 0:  # the previous step's counter: read while this one runs
          mnjax.raise_if_diverging(previous.opt_state, config.max_consecutive_skips)
        sums = jax.tree.map(lambda a, b: a + b, sums, metrics)
        step += 1
        if config.checkpoint_steps and step % config.checkpoint_steps == 0:
          checkpoints.save(step, state, sums, epoch, i + 1)
      jax.block_until_ready(state)
      seconds = time.perf_counter() - start
      mnjax.check_replicas((state.params, state.batch_stats), comm)
      train = mnjax.global_mean(mnjax.allreduce_metrics(sums, comm))
      per_rank = (steps - begin) * per_process / seconds
      record = {
          "epoch": epoch, "steps": step, "epoch_seconds": seconds,
          "train_loss": train["loss"], "train_top1": train["correct"],
          "images_per_second_per_rank": per_rank,
          "images_per_second": per_rank * comm.size,
          "input_wait_share": (train_loader.wait_seconds - waited) / seconds,
          "skipped_steps": int(state.opt_state[1].skipped),
      }
      if baseline:
        record["parallel_efficiency"] = per_rank / baseline
      if test_loader is not None:
        test = bn_classifier.evaluate(state, test_loader, comm)
        record.update(test_loss=test["loss"], test_top1=test["correct"], test_count=test["count"])
      log.write(**record)
      sums = ZERO_SUMS
      if config.checkpoint_every and epoch % config.checkpoint_every == 0:
        checkpoints.save(step, state, sums, epoch + 1, 0)
      if comm.is_root:
        print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  top-1 {record['train_top1']:.4f}"
              + (f"  test top-1 {record['test_top1']:.4f}" if "test_top1" in record else "")
              + f"  {record['images_per_second']:,.1f} img/s ({per_rank:,.1f}/rank)"
              f"  {seconds:.1f} s  input wait {record['input_wait_share']:.1%}"
              + (f"  efficiency {record['parallel_efficiency']:.3f}" if baseline else "")
              + (f"  {record['skipped_steps']} non-finite steps skipped"
                 if record["skipped_steps"] else "")
              + ("  (includes compilation)" if epoch == first_epoch else ""), flush=True)
  return state, record


def main(argv: list[str] | None = None) -> None:
  config = parse_args(argv)
  comm = mnjax.create_communicator(config.comm)
  _, record = train_and_evaluate(config, comm)
  if comm.is_root:
    print(f"done: {json.dumps(record)}")


if __name__ == "__main__":
  main()
