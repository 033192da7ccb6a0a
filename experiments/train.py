"""Data-parallel training of a small CNN on the UCI handwritten digits (the main job).

Run (the README's first command does the set-up, then this):

    mpirun -n 2 python experiments/train.py                 # ~20 s on 2 CPU cores
    python experiments/train.py                             # one process, same script
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      mpirun -n 2 python experiments/train.py --comm hierarchical   # 2 processes x 2 devices
    srun -n 8 python experiments/train.py --workdir runs/d8 # on a Slurm cluster

Rank 0 shows a progress bar, prints per-epoch loss, accuracy and images/s, and writes
``config.json``, ``metrics.jsonl`` and the final ``params.npz`` to ``--workdir``. Expected: >= 97% test accuracy after
the default 20 epochs, at any number of ranks that divides the global batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import optax
from tqdm import tqdm

import mnjax
from mnjax.classifier import create_train_state, evaluate, make_train_step
from mnjax.models import SmallCNN


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that defines a run; written to ``config.json``."""

  dataset: str = "digits"
  comm: str = "flat"
  wire_dtype: str = "float32"  # or bfloat16 / float16: gradients cross processes in 16 bits
  bucket_mb: float = 4.0  # largest fused gradient buffer; 0: one buffer per dtype
  epochs: int = 20
  global_batch_size: int = 64
  learning_rate: float = 1e-3
  seed: int = 0
  workdir: str = "runs/digits"
  progress: bool = True


def parse_args(argv: list[str] | None = None) -> Config:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for field in dataclasses.fields(Config):
    if field.type == "bool":
      parser.add_argument(
          f"--{field.name}", action=argparse.BooleanOptionalAction, default=field.default
      )
    else:
      kind = {"int": int, "float": float, "str": str}[field.type]
      parser.add_argument(f"--{field.name}", type=kind, default=field.default)
  parser.set_defaults(comm="flat")
  return Config(**vars(parser.parse_args(argv)))


def train_and_evaluate(config: Config, comm: mnjax.Communicator) -> dict:
  """Trains for ``config.epochs`` and returns the last epoch's record."""
  mnjax.local_batch_size(config.global_batch_size, comm)  # fail fast, on every rank
  train = mnjax.datasets.load(config.dataset, "train")
  test = mnjax.datasets.load(config.dataset, "test")

  allreduce = mnjax.allreduce_gradients(
      comm, wire_dtype=config.wire_dtype,
      bucket_bytes=None if config.bucket_mb == 0 else int(config.bucket_mb * 2**20))
  tx = optax.chain(allreduce, optax.adam(config.learning_rate))
  model = SmallCNN(num_classes=train.num_classes)
  state = create_train_state(model, tx, train.images[:1], jax.random.key(config.seed))
  state = mnjax.broadcast(state, comm, root=0)

  mnjax.workdir.write_config(config.workdir, config, comm)
  log = mnjax.workdir.MetricsLog(config.workdir, comm)
  if comm.is_root:
    print(f"mnjax: {comm.size} rank(s) x {comm.local_device_count} device(s), kind"
          f" {comm.kind}, global batch {config.global_batch_size}, {len(train)} train / {len(test)} test examples")

  train_step = make_train_step(comm)
  record: dict = {}
  for epoch in range(1, config.epochs + 1):
    batches = list(mnjax.epoch_batches(
        len(train), comm, config.global_batch_size, shuffle=True, seed=config.seed,
        epoch=epoch,
    ))
    sums = {"loss_sum": 0.0, "correct": 0, "count": 0}
    start = time.perf_counter()
    for idx, _ in tqdm(batches, desc=f"epoch {epoch}", leave=False,
                       disable=not (comm.is_root and config.progress)):
      state, metrics = train_step(state, train.images[idx], train.labels[idx])
      sums = jax.tree.map(lambda a, b: a + b, sums, metrics)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    train_metrics = mnjax.global_mean(mnjax.allreduce_metrics(sums, comm))
    test_metrics = evaluate(state, test.images, test.labels, comm, config.global_batch_size)
    record = {
        "epoch": epoch,
        "train_loss": train_metrics["loss"],
        "train_accuracy": train_metrics["correct"],
        "test_loss": test_metrics["loss"],
        "test_accuracy": test_metrics["correct"],
        "test_count": test_metrics["count"],
        "epoch_seconds": seconds,
        "images_per_second": len(batches) * config.global_batch_size / seconds,
        "steps": int(state.step),
    }
    log.write(**record)
    if comm.is_root:
      print(f"epoch {epoch:3d}  train loss {record['train_loss']:.4f}"
            f" acc {record['train_accuracy']:.4f}  test loss {record['test_loss']:.4f}"
            f" acc {record['test_accuracy']:.4f}  {record['images_per_second']:,.0f} img/s"
            + ("  (includes compilation)" if epoch == 1 else ""), flush=True)
  mnjax.workdir.save_params(config.workdir, state.params, comm)
  return record


def main(argv: list[str] | None = None) -> None:
  config = parse_args(argv)
  comm = mnjax.create_communicator(config.comm)  # kinds: mnjax.KINDS
  record = train_and_evaluate(config, comm)
  if comm.is_root:
    print(f"final test accuracy {record['test_accuracy']:.4f}"
          f" ({record['test_count']} examples); metrics in {config.workdir}/metrics.jsonl")


if __name__ == "__main__":
  main()
