"""The ChainerMN experiment: ResNet on ImageNet (or CIFAR-10, MNIST, digits, synthetic data).

Configs are files in ``experiments/configs/`` (``--config NAME`` or a path; each file's
docstring gives its command and the time it takes); any flag overrides a field:

* ``resnet18_digits`` (the default; also ``--config digits``): ResNet-18 on the 8x8 digits,
  offline: ``mpirun -n 2 python experiments/imagenet.py``.
* ``resnet18_cifar10`` (``cifar10``): ResNet-18, CIFAR stem, 128 per step, 30 epochs.
* ``resnet50_goyal`` (``imagenet``): ResNet-50 on ImageNet-1k at 224 px with Goyal et al.'s
  recipe and synchronized BN, 90 epochs (ChainerMN's experiment).
* ``resnet50_synthetic`` (``synthetic``): ResNet-50 on random ImageNet-shaped images, for
  throughput (no data).
* ``imagenet_15min``: Akiba et al. 2017's 32k-batch ResNet-50 (RMSprop warm-up, slow start,
  BN without moving averages, float16 wire); ``akiba_digits`` is its offline scale-down.

Rank 0 prints per epoch: loss and top-1 accuracy (train and test), images/s per rank and in
total, epoch time, the share of time the loop waited for input, and with
``--baseline_workdir`` (the same config run with 1 rank) the parallel efficiency. The work
directory gets ``config.json``, ``metrics.jsonl`` (also as TensorBoard scalars in
``tensorboard/``, with the learning rate; ``--tensorboard``), a ``jax.profiler`` trace in
``profile/`` with ``--profile_steps`` and ``checkpoints/`` (orbax, every
``--checkpoint_every`` epochs and ``--checkpoint_steps`` steps: parameters, batch
statistics, optimizer state and the data position). A killed run continues exactly where
its newest checkpoint left off with ``--resume``; the loop is the digits job's
(`lab.runner.train_loop`: abort on error, stall watchdog, non-finite step skipping, replica
comparison after each epoch).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import ClassVar

# MPI starts before jax fills the heap: under srun, MPICH's PMI-2 client can send stray heap
# bytes otherwise (docs/design/launchers.md, "MPI before jax").
from mpi4py import MPI  # noqa: F401

# isort: split
import flax.linen as nn
import jax
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/, beside mnjax/

import lab.runner
import mnjax
from lab import augment, models
from lab.runner import flag
from mnjax.data import Loader
from mnjax.optim import recipes

CONFIGS = Path(__file__).resolve().parent / "configs"
# Short names `--config` also accepts.
ALIASES = {"digits": "resnet18_digits", "cifar10": "resnet18_cifar10",
           "imagenet": "resnet50_goyal", "synthetic": "resnet50_synthetic"}
MODELS = {"resnet6": models.ResNet6, "resnet10": models.ResNet10, "resnet18": models.ResNet18,
          "resnet34": models.ResNet34, "resnet50": models.ResNet50, "resnet101": models.ResNet101,
          "resnet152": models.ResNet152}
OPTIMIZERS = ("goyal", "lars", "rmsprop_warmup")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(lab.runner.RunConfig):
  """Everything that defines a run; written to ``config.json``."""

  # Fields that fix the data order and the optimizer: a resumed run must keep them.
  resume_settings: ClassVar[tuple[str, ...]] = (
      "dataset", "model", "global_batch_size", "optimizer", "base_lr", "warmup_epochs", "seed",
      "steps_per_epoch", "image_size", "blend_center", "blend_period")

  dataset: str = flag(help="a source of mnjax.data.open_source (digits, synthetic: offline)")
  model: str = flag(choices=sorted(MODELS))
  stem: str = flag(choices=("cifar", "imagenet"), help="cifar: 3x3, no pooling")
  data_dir: str = flag("", help="tensorflow-datasets' data_dir ('': its default)")
  image_size: int = flag(0, minimum=0, help="imagenet2012/synthetic side (0: 224)")
  sync_bn: bool = flag(True, help="mnjax.SyncBatchNorm (else per-replica flax BatchNorm)")
  bn_momentum: float = flag(0.9, minimum=0.0, help="0.0: evaluate with the last global"
                            " minibatch's statistics")
  optimizer: str = flag("goyal", choices=OPTIMIZERS)
  base_lr: float = flag(0.1, minimum=0.0, help="per 256 examples (linear scaling)")
  warmup_epochs: float = flag(5.0, minimum=0.0, help="goyal, lars: linear warmup epochs")
  blend_center: float = flag(10.0, help="rmsprop_warmup: epoch where SGD has half the step")
  blend_period: float = flag(5.0, help="rmsprop_warmup: the blend's period in epochs (> 0)")
  label_smoothing: float = flag(0.0, minimum=0.0)
  steps_per_epoch: int = flag(0, minimum=0, help="0: the whole split; else at most this many")
  eval: bool = flag(True, help="evaluate on the test split after every epoch")


def parse_args(argv: list[str] | None = None) -> Config:
  """The run's `Config`: ``--config`` (default ``resnet18_digits``) and any field as a flag."""
  return lab.runner.parse_flags(Config, argv, default="resnet18_digits", configs_dir=CONFIGS,
                                 aliases=ALIASES, description=__doc__.splitlines()[0])


def learning_rate(config: Config, steps_per_epoch: int) -> optax.Schedule:
  """The recipe's learning rate by step (rmsprop_warmup: SGD's, the slow start)."""
  if config.optimizer == "rmsprop_warmup":
    return recipes.slow_start_schedule(config.global_batch_size, steps_per_epoch,
                                       base_lr=config.base_lr)
  return recipes.goyal_schedule(config.global_batch_size, steps_per_epoch,
                                base_lr=config.base_lr, warmup_epochs=config.warmup_epochs)


def optimizer(config: Config, steps_per_epoch: int) -> optax.GradientTransformation:
  """The config's large-batch recipe (before the allreduce and the non-finite guard)."""
  schedule = learning_rate(config, steps_per_epoch)
  if config.optimizer == "lars":
    return recipes.lars(schedule)
  if config.optimizer == "rmsprop_warmup":  # Akiba et al. 2017: slow start, ELU-shaped blend
    blend = recipes.akiba_blend(steps_per_epoch, center=config.blend_center,
                                period=config.blend_period)
    return optax.chain(optax.add_decayed_weights(1e-4, recipes.decay_mask),
                       recipes.rmsprop_warmup(schedule, blend))
  return recipes.goyal_sgd(config.global_batch_size, steps_per_epoch, base_lr=config.base_lr,
                           warmup_epochs=config.warmup_epochs)


def train_and_evaluate(config: Config, comm: mnjax.Communicator):
  """Trains for ``config.epochs``; returns the final state and the last epoch's record."""
  per_process = mnjax.local_batch_size(config.global_batch_size, comm)  # fails on every rank
  open_split = functools.partial(mnjax.data.open_source, config.dataset,
                                 data_dir=config.data_dir or None,
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
  tx = lab.runner.guarded_optimizer(optimizer(config, steps), comm, config)
  sample = eval_fn(train_source[0][0], None)[None]  # one preprocessed image: the input shape
  state = lab.runner.create_train_state(model, tx, sample, jax.random.key(config.seed))
  # Rank 0's parameters on every rank (the optimizer state follows from them; with
  # --shard_optimizer each rank holds its own share of it).
  state = state.replace(params=mnjax.broadcast(state.params, comm, root=0))

  return lab.runner.train_loop(
      config, comm, state,
      lab.runner.make_train_step(comm, label_smoothing=config.label_smoothing),
      lambda epoch, start: train_loader.epoch(epoch, start=start), steps_per_epoch=steps,
      eval_batches=(lambda: test_loader.epoch(0)) if test_loader is not None else None,
      learning_rate=learning_rate(config, steps),
      header=f"{config.model} on {config.dataset} ({len(train_source)} train examples,"
             f" {'synchronized' if config.sync_bn else 'per-replica'} BN)")


def main(argv: list[str] | None = None) -> None:
  config = parse_args(argv)
  comm = mnjax.create_communicator(config.comm, replicas=config.replicas or None)
  _, record = train_and_evaluate(config, comm)
  if comm.is_root:
    print(f"done: {json.dumps(record)}")


if __name__ == "__main__":
  main()
