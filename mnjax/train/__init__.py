"""Layer 4 — training: running a per-device step, exact metrics, the reference loop.

* `data_parallel`: the right execution of a per-device step for the communicator kind.
* `allreduce_metrics` / `global_mean`: exact metrics from per-rank sums and counts.
* `mean_metrics`: exact metrics from per-rank means (a step ported from ``jax.lax.pmean``).
* `MetricsLog`, `write_config`, `save_params`: a run's work directory, written by rank 0;
  a failed write raises the same error on every rank.
* `WorkdirLock`: one run per work directory (`train_loop` holds it while it runs).
* `generic_multi_node_evaluator`: metrics that do not add up (a median, an AUC), from every
  rank's per-batch results, aggregated on the root (ChainerMN's ``GenericMultiNodeEvaluator``).
* `multi_node_early_stopping`: early stopping on a metric averaged over every rank's
  observations; every rank stops at the same check (``MultiNodeEarlyStoppingTrigger``).
* `flush_pending`: double buffering's per-rank pending gradients summed before a checkpoint.
* The classifier (`create_train_state`, `make_train_step`, `evaluate` over masked batches):
  one state, step and evaluation, with or without batch statistics.
* `train_loop`: the guarded epoch loop every experiment runs, with its `RunConfig`.
* `PreemptionSignals` / `Preempted` / `requeued`: SIGTERM/SIGUSR1 (Slurm's scancel,
  ``--signal``) checkpoint and stop the loop; a requeued Slurm job resumes by itself.
* `parse_flags`: flags from a frozen config dataclass and ``get_config()`` files.
* `TensorBoard` / `scalar_tags`: the epoch records as TensorBoard scalars (rank 0, no
  TensorFlow); `StepProfiler` / `profile_window`: a ``jax.profiler`` trace of a few steps.

Example::

    step = mnjax.train.data_parallel(train_step, comm, batch_argnums=(1, 2))
"""

from mnjax.train._classifier import (
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
from mnjax.train._early_stopping import (
    EarlyStopping,
    EarlyStoppingState,
    multi_node_early_stopping,
)
from mnjax.train._flags import check_fields, flag, load_config, parse_flags
from mnjax.train._lock import WorkdirLock
from mnjax.train._loop import RunConfig, guarded_optimizer, skipped_steps, train_loop
from mnjax.train._metrics import allreduce_metrics, global_mean, mean_metrics
from mnjax.train._multi_node_evaluator import generic_multi_node_evaluator
from mnjax.train._parallel import data_parallel
from mnjax.train._pending import flush_pending
from mnjax.train._preemption import Preempted, PreemptionSignals, parse_signals, requeued
from mnjax.train._profile import StepProfiler, profile_window
from mnjax.train._step_checks import process_local
from mnjax.train._tensorboard import TensorBoard, scalar_tags
from mnjax.train._workdir import MetricsLog, save_params, write_config

__all__ = [
    "EarlyStopping",
    "EarlyStoppingState",
    "MetricsLog",
    "Preempted",
    "PreemptionSignals",
    "RunConfig",
    "StepProfiler",
    "TensorBoard",
    "TrainState",
    "WorkdirLock",
    "allreduce_metrics",
    "check_fields",
    "classification_sums",
    "create_train_state",
    "data_parallel",
    "eval_batches",
    "eval_step",
    "evaluate",
    "flag",
    "flush_pending",
    "generic_multi_node_evaluator",
    "global_mean",
    "guarded_optimizer",
    "load_config",
    "make_train_step",
    "mean_metrics",
    "multi_node_early_stopping",
    "parse_flags",
    "parse_signals",
    "process_local",
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
