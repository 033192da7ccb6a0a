"""Flax layers that need the communicator: `SyncBatchNorm` (global-batch statistics),
`create_mnbn_model` (a model's BatchNorm layers as `SyncBatchNorm`) and `allreduce_persistent`
(float persistent values, such as batch statistics, averaged over ranks).

Example::

    norm = partial(mnjax.nn.SyncBatchNorm, comm=comm, use_running_average=not train)
"""

from mnjax.comm._host._broadcast import allreduce_persistent
from mnjax.nn._batch_norm import SyncBatchNorm
from mnjax.nn._convert import create_mnbn_model

__all__ = ["SyncBatchNorm", "allreduce_persistent", "create_mnbn_model"]
