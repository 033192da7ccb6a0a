"""Data-parallel training of a small CNN on the UCI handwritten digits (the main job).

Run (the README's first command does the set-up, then this):

    mpirun -n 2 python experiments/train.py                 # ~20 s on 2 CPU cores
    python experiments/train.py                             # one process, same script
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      mpirun -n 2 python experiments/train.py --comm hierarchical   # 2 processes x 2 devices
    srun -n 8 python experiments/train.py --workdir runs/d8 # on a Slurm cluster

Rank 0 shows a progress bar, prints per-epoch loss, accuracy and images/s, and writes
``config.json``, ``metrics.jsonl``, ``checkpoints/`` (after every epoch, and every
``--checkpoint_steps``) and the final ``params.npz`` to ``--workdir``. Expected: >= 97% test
accuracy after the default 20 epochs, at any number of ranks that divides the global batch.

Failures end the job instead of hanging it: an exception on any rank aborts all of them, the
stall watchdog aborts when ranks drift ``--stall_timeout`` seconds apart, a step with a
non-finite gradient is skipped on every rank, and the replicas are compared after every
epoch. A killed run continues where its last checkpoint left off, bit for bit:

    mpirun -n 2 python experiments/train.py --workdir runs/d2 --resume
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

import jax
import numpy as np
import optax
from tqdm import tqdm

import mnjax
from mnjax.train._classifier import create_train_state, evaluate, make_train_step
from mnjax.models import SmallCNN


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that defines a run; written to ``config.json``."""

  dataset: str = "digits"
  comm: str = "auto"  # a kind of mnjax.KINDS; auto: xla on GPUs, flat on CPUs
  wire_dtype: str = "float32"  # or bfloat16 / float16: gradients cross processes in 16 bits
  bucket_mb: str = "auto"  # largest fused gradient buffer in MiB; auto: the platform default; 0: one buffer per dtype
  epochs: int = 20
  global_batch_size: int = 64
  learning_rate: float = 1e-3
  seed: int = 0
  workdir: str = "runs/digits"
  progress: bool = True
  resume: bool = False  # continue from the newest intact checkpoint in <workdir>/checkpoints
  checkpoint_steps: int = 0  # checkpoint every N steps as well as after every epoch; 0: epochs only
  keep_checkpoints: int = 3
  max_consecutive_skips: int = 10  # steps with NaN/Inf gradients skipped in a row before failing
  stall_timeout: float = 300.0  # watchdog: seconds ranks may drift apart; 0 disables it


# Fields that fix the data order and the optimizer: a resumed run must keep them.
# Reading the skip counter waits for a step: every 10 steps it costs nothing measurable.
DIVERGENCE_CHECK_EVERY = 10
# The train step's metric sums, zero (checkpoints hold an epoch's partial sums).
ZERO_SUMS = {"loss_sum": np.float32(0), "correct": np.int32(0), "count": np.int32(0)}
RESUME_SETTINGS = ("dataset", "global_batch_size", "learning_rate", "seed")


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
  return Config(**vars(parser.parse_args(argv)))


def train_and_evaluate(config: Config, comm: mnjax.Communicator) -> dict:
  """Trains for ``config.epochs`` (or the rest of them, with ``resume``); returns the last
  epoch's record."""
  mnjax.local_batch_size(config.global_batch_size, comm)  # fail fast, on every rank
  train = mnjax.data.load(config.dataset, "train")
  test = mnjax.data.load(config.dataset, "test")

  allreduce = mnjax.allreduce_gradients(
      comm, wire_dtype=config.wire_dtype,
      bucket_bytes=mnjax.comm.bucket_bytes_from_mb(config.bucket_mb))
  # After the allreduce every rank holds the same gradient, so all skip a NaN step together.
  tx = optax.chain(allreduce, mnjax.skip_nonfinite(optax.adam(config.learning_rate)))
  model = SmallCNN(num_classes=train.num_classes)
  state = create_train_state(model, tx, train.images[:1], jax.random.key(config.seed))
  state = mnjax.broadcast(state, comm, root=0)

  checkpoints = mnjax.LoopCheckpoints(
      os.path.join(config.workdir, "checkpoints"), comm, resume=config.resume,
      keep=config.keep_checkpoints, settings={k: getattr(config, k) for k in RESUME_SETTINGS})
  state, sums, first_epoch, first_batch = checkpoints.start(state, ZERO_SUMS)
  step = int(state.step)

  mnjax.train.write_config(config.workdir, config, comm)
  log = mnjax.train.MetricsLog(config.workdir, comm)
  if comm.is_root:
    print(f"mnjax: {comm.summary}{' (--comm auto)' if config.comm == 'auto' else ''},"
          f" global batch {config.global_batch_size}, {len(train)} train /"
          f" {len(test)} test examples"
          + (f"; resuming at epoch {first_epoch}, batch {first_batch} (step {step})"
             if step else ""))

  train_step = make_train_step(comm)
  record: dict = {}
  watchdog = mnjax.Watchdog(comm, timeout=config.stall_timeout) if config.stall_timeout else None
  with contextlib.ExitStack() as stack:
    stack.callback(checkpoints.close)
    if watchdog is not None:
      stack.enter_context(watchdog)
    for epoch in range(first_epoch, config.epochs + 1):
      batches = list(mnjax.epoch_batches(
          len(train), comm, config.global_batch_size, shuffle=True, seed=config.seed,
          epoch=epoch,
      ))
      start = time.perf_counter()
      begin = first_batch if epoch == first_epoch else 0
      for i in tqdm(range(begin, len(batches)), desc=f"epoch {epoch}", leave=False,
                    disable=not (comm.is_root and config.progress)):
        if watchdog is not None:
          watchdog.step(step)
        idx, _ = batches[i]
        previous = state
        state, metrics = train_step(state, train.images[idx], train.labels[idx])
        if step % DIVERGENCE_CHECK_EVERY == 0:  # the previous step's counter: read while this one runs
          mnjax.raise_if_diverging(previous.opt_state, config.max_consecutive_skips)
        sums = jax.tree.map(lambda a, b: a + b, sums, metrics)
        step += 1
        if config.checkpoint_steps and step % config.checkpoint_steps == 0:
          checkpoints.save(step, state, sums, epoch, i + 1)
      jax.block_until_ready(state)
      seconds = time.perf_counter() - start
      mnjax.check_replicas(state.params, comm)  # replicas still bitwise identical?
      train_metrics = mnjax.global_mean(mnjax.allreduce_metrics(sums, comm))
      test_metrics = evaluate(state, test.images, test.labels, comm, config.global_batch_size)
      skips = state.opt_state[1]
      record = {
          "epoch": epoch,
          "train_loss": train_metrics["loss"],
          "train_accuracy": train_metrics["correct"],
          "test_loss": test_metrics["loss"],
          "test_accuracy": test_metrics["correct"],
          "test_count": test_metrics["count"],
          "epoch_seconds": seconds,
          "images_per_second": (len(batches) - begin) * config.global_batch_size / seconds,
          "steps": step,
          "skipped_steps": int(skips.skipped),
      }
      log.write(**record)
      if comm.is_root:
        print(f"epoch {epoch:3d}  train loss {record['train_loss']:.4f}"
              f" acc {record['train_accuracy']:.4f}  test loss {record['test_loss']:.4f}"
              f" acc {record['test_accuracy']:.4f}  {record['images_per_second']:,.0f} img/s"
              + (f"  {record['skipped_steps']} non-finite steps skipped"
                 if record["skipped_steps"] else "")
              + ("  (includes compilation)" if epoch == first_epoch else ""), flush=True)
      sums = ZERO_SUMS
      checkpoints.save(step, state, sums, epoch + 1, 0)
  if not record:  # resumed a finished run: report where it ended
    test_metrics = evaluate(state, test.images, test.labels, comm, config.global_batch_size)
    record = {"epoch": first_epoch - 1, "test_accuracy": test_metrics["correct"],
              "test_count": test_metrics["count"], "steps": step}
  mnjax.train.save_params(config.workdir, state.params, comm)
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
