"""Running a per-device step over a communicator, and what a step reports.

* `data_parallel`: the right execution of a per-device step for the communicator kind.
* `process_local`: marks a step output that may differ across a process's local devices.
* `allreduce_metrics` / `global_mean`: exact metrics from per-rank sums and counts.
* `mean_metrics`: exact metrics from per-rank means (a step ported from ``jax.lax.pmean``).
* `generic_multi_node_evaluator`: metrics that do not add up (a median, an AUC), from every
  rank's per-batch results, aggregated on the root (ChainerMN's ``GenericMultiNodeEvaluator``).
* `multi_node_early_stopping`: early stopping on a metric averaged over every rank's
  observations; every rank stops at the same check (``MultiNodeEarlyStoppingTrigger``).
* `flush_pending`: double buffering's per-rank pending gradients summed before a checkpoint.

Example::

    step = mnjax.train.data_parallel(train_step, comm, batch_argnums=(1, 2))
"""

from mnjax.train._early_stopping import (
    EarlyStopping,
    EarlyStoppingState,
    multi_node_early_stopping,
)
from mnjax.train._metrics import allreduce_metrics, global_mean, mean_metrics
from mnjax.train._multi_node_evaluator import generic_multi_node_evaluator
from mnjax.train._parallel import data_parallel
from mnjax.train._pending import flush_pending
from mnjax.train._step_checks import process_local

__all__ = [
    "EarlyStopping",
    "EarlyStoppingState",
    "allreduce_metrics",
    "data_parallel",
    "flush_pending",
    "generic_multi_node_evaluator",
    "global_mean",
    "mean_metrics",
    "multi_node_early_stopping",
    "process_local",
]
