"""Data-parallel training of a small CNN on the UCI handwritten digits (the main job).

Run (the README's first command does the set-up, then this):

    mpirun -n 2 python experiments/train.py                 # ~20 s on 2 CPU cores
    python experiments/train.py                             # one process, same script
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      mpirun -n 2 python experiments/train.py --comm hierarchical   # 2 processes x 2 devices
    srun -n 8 python experiments/train.py --workdir runs/d8 # on a Slurm cluster
    mpirun -n 3 python experiments/train.py --replicas 12 --global_batch_size 96
                                    # the same bits on 1, 2, 3, 4 or 6 processes

The config is ``experiments/configs/digits.py`` (``--config`` picks another file); every
field is a flag (``--help``). Rank 0 shows a progress bar, prints per-epoch loss, accuracy
and images/s, and writes ``config.json``, ``metrics.jsonl`` (and the same numbers as
TensorBoard scalars in ``tensorboard/``, ``--tensorboard``), ``checkpoints/`` (after every
epoch, and every ``--checkpoint_steps``) and the final ``params.npz`` to ``--workdir``;
``--profile_steps 10:13`` adds a ``jax.profiler`` trace of steps 10-12 in ``profile/``.
Expected: >= 97% test accuracy after the default 20 epochs, at any number of ranks that
divides the global batch.

Failures end the job instead of hanging it (`lab.runner.train_loop`): an exception on any
rank aborts all of them, the stall watchdog aborts when ranks drift ``--stall_timeout``
seconds apart, a step with a non-finite gradient is skipped on every rank, and the replicas
are compared after every epoch. A killed run continues where its last checkpoint left off,
bit for bit:

    mpirun -n 2 python experiments/train.py --workdir runs/d2 --resume
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import ClassVar

# MPI starts before jax fills the heap: under srun, MPICH's PMI-2 client can send stray heap
# bytes otherwise (docs/design/launchers.md, "MPI before jax").
from mpi4py import MPI  # noqa: F401

# isort: split
import jax
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/, beside mnjax/

import lab.runner
import mnjax
from lab.models import SmallCNN
from lab.runner import flag, make_train_step

CONFIGS = Path(__file__).resolve().parent / "configs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(lab.runner.RunConfig):
  """Everything that defines a run; written to ``config.json``."""

  # Fields that fix the data order and the optimizer: a resumed run must keep them.
  resume_settings: ClassVar[tuple[str, ...]] = (
      "dataset", "global_batch_size", "learning_rate", "seed")

  dataset: str = flag(help="a dataset of mnjax.data.load (digits: offline)")
  learning_rate: float = flag(minimum=0.0, help="Adam's learning rate")


def parse_args(argv: list[str] | None = None) -> Config:
  """The run's `Config`: ``--config`` (default ``digits``) and any field as a flag."""
  return lab.runner.parse_flags(Config, argv, default="digits", configs_dir=CONFIGS,
                                 description=__doc__.splitlines()[0])


def train_and_evaluate(config: Config, comm: mnjax.Communicator):
  """Trains for ``config.epochs`` (or the rest of them, with ``resume``); returns the final
  state and the last epoch's record."""
  mnjax.local_batch_size(config.global_batch_size, comm)  # fail fast, on every rank
  train = mnjax.data.load(config.dataset, "train")
  test = mnjax.data.load(config.dataset, "test")

  tx = lab.runner.guarded_optimizer(optax.adam(config.learning_rate), comm, config)
  state = lab.runner.create_train_state(SmallCNN(num_classes=train.num_classes), tx,
                                         train.images[:1], jax.random.key(config.seed))
  # Rank 0's parameters on every rank (the optimizer state follows from them; with
  # --shard_optimizer each rank holds its own share of it).
  state = state.replace(params=mnjax.broadcast(state.params, comm, root=0))

  def epoch_order(epoch):
    return mnjax.epoch_batches(len(train), comm, config.global_batch_size, shuffle=True,
                               seed=config.seed, epoch=epoch)

  def batches(epoch, start):
    for idx, _ in list(epoch_order(epoch))[start:]:
      yield train.images[idx], train.labels[idx]

  state, record = lab.runner.train_loop(
      config, comm, state, make_train_step(comm), batches,
      steps_per_epoch=sum(1 for _ in epoch_order(0)),
      eval_batches=lambda: lab.runner.eval_batches(test.images, test.labels, comm,
                                                    config.global_batch_size),
      learning_rate=config.learning_rate,
      header=f"SmallCNN on {config.dataset} ({len(train)} train / {len(test)} test examples)")
  lab.runner.save_params(config.workdir, state.params, comm)
  return state, record


def main(argv: list[str] | None = None) -> None:
  config = parse_args(argv)
  comm = mnjax.create_communicator(config.comm, replicas=config.replicas or None)
  _, record = train_and_evaluate(config, comm)
  if comm.is_root:
    print(f"final test accuracy {record['test_accuracy']:.4f}"
          f" ({record['test_count']} examples); metrics in {config.workdir}/metrics.jsonl")


if __name__ == "__main__":
  main()
