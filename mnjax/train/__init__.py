"""Running a per-device step over a communicator, and what a step reports.

* `data_parallel`, `process_local`: a per-device step run right for the communicator kind;
  `replica_index`: inside it, this replica's index in the job (per-replica randomness).
* `allreduce_metrics`, `global_mean`, `mean_metrics`: exact metrics over every rank.
* `generic_multi_node_evaluator`: metrics that do not add up (a median, an AUC).
* `multi_node_early_stopping`: every rank stops at the same check.
* `flush_pending`: double buffering's pending gradients summed before a checkpoint.

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
from mnjax.train._parallel import data_parallel, replica_index
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
    "replica_index",
]
