"""The experiments' runner: the reference classifier, the guarded epoch loop and its run.

Not part of the library: `experiments/` and the benchmarks build on it, a training script of
one's own need not (flax keeps its loop in the example; this is ours).

* The classifier (`create_train_state`, `make_train_step`, `evaluate` over masked batches):
  one state, step and evaluation, with or without batch statistics.
* `train_loop`: the guarded epoch loop every experiment runs, with its `RunConfig`, and the
  optimizer it builds from the run's options (`guarded_optimizer`).
* `MetricsLog`, `write_config`, `save_params`: a run's work directory, written by rank 0;
  `WorkdirLock`: one run per work directory.
* `PreemptionSignals` / `Preempted` / `requeued`: SIGTERM/SIGUSR1 (Slurm's scancel,
  ``--signal``) checkpoint and stop the loop; a requeued Slurm job resumes by itself.
* `parse_flags`: flags from a frozen config dataclass and ``get_config()`` files.
* `TensorBoard` / `scalar_tags`: the epoch records as TensorBoard scalars (rank 0);
  `StepProfiler` / `profile_window`: a ``jax.profiler`` trace of a few steps.
"""

from lab.runner._classifier import (
    TrainState,
    classification_sums,
    create_train_state,
    eval_batches,
    eval_step,
    evaluate,
    make_train_step,
    train_step,
    zero_sums,
)
from lab.runner._flags import check_fields, flag, load_config, parse_flags
from lab.runner._lock import WorkdirLock
from lab.runner._loop import RunConfig, guarded_optimizer, skipped_steps, train_loop
from lab.runner._preemption import Preempted, PreemptionSignals, parse_signals, requeued
from lab.runner._profile import StepProfiler, profile_window
from lab.runner._tensorboard import TensorBoard, scalar_tags
from lab.runner._workdir import MetricsLog, save_params, write_config

__all__ = [
    "MetricsLog",
    "Preempted",
    "PreemptionSignals",
    "RunConfig",
    "StepProfiler",
    "TensorBoard",
    "TrainState",
    "WorkdirLock",
    "check_fields",
    "classification_sums",
    "create_train_state",
    "eval_batches",
    "eval_step",
    "evaluate",
    "flag",
    "guarded_optimizer",
    "load_config",
    "make_train_step",
    "parse_flags",
    "parse_signals",
    "profile_window",
    "requeued",
    "save_params",
    "scalar_tags",
    "skipped_steps",
    "train_loop",
    "train_step",
    "write_config",
    "zero_sums",
]
