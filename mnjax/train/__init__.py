"""Layer 4 — training: running a per-device step, exact metrics, the reference loop.

* `data_parallel`: the right execution of a per-device step for the communicator kind.
* `allreduce_metrics` / `global_mean`: exact metrics from per-rank sums and counts.
* `MetricsLog`, `write_config`, `save_params`: a run's work directory, written by rank 0.

Example::

    step = mnjax.train.data_parallel(train_step, comm, batch_argnums=(1, 2))
"""

from mnjax.train._metrics import allreduce_metrics, global_mean
from mnjax.train._parallel import data_parallel
from mnjax.train._workdir import MetricsLog, save_params, write_config

__all__ = [
    "MetricsLog",
    "allreduce_metrics",
    "data_parallel",
    "global_mean",
    "save_params",
    "write_config",
]
