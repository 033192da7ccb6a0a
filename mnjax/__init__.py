"""mnjax: ChainerMN-style synchronous data-parallel training for JAX.

Gradient allreduce is an optax transformation; MPI (through mpi4jax) moves the gradients::

    import mnjax, optax
    comm = mnjax.create_communicator()              # one MPI process per device
    params = mnjax.broadcast(params, comm, root=0)  # identical start on every rank
    tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))

Run the script under ``mpirun -n 4`` or ``srun``, or alone for a size-1 communicator.

Subpackages, from the bottom layer up (docs/design/overview.md): comm; guard, data, nn; optim;
checkpoint, train; functions; model_parallel. Re-exported here: the names most scripts need.
"""

from mnjax import (
    checkpoint,
    comm,
    data,
    functions,
    guard,
    model_parallel,
    nn,
    optim,
    train,
)
from mnjax.checkpoint import Checkpointer
from mnjax.comm import Communicator, broadcast, create_communicator
from mnjax.data import epoch_batches, local_batch_size, scatter_dataset, scatter_index
from mnjax.guard import Watchdog, check_replicas
from mnjax.nn import SyncBatchNorm
from mnjax.optim import (
    accumulate_gradients,
    allreduce_gradients,
    create_multi_node_optimizer,
    shard_optimizer,
    skip_nonfinite,
)
from mnjax.train import allreduce_metrics, data_parallel, mean_metrics, process_local

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "Communicator",
    "SyncBatchNorm",
    "Watchdog",
    "accumulate_gradients",
    "allreduce_gradients",
    "allreduce_metrics",
    "broadcast",
    "check_replicas",
    "checkpoint",
    "comm",
    "create_communicator",
    "create_multi_node_optimizer",
    "data",
    "data_parallel",
    "epoch_batches",
    "functions",
    "guard",
    "local_batch_size",
    "mean_metrics",
    "model_parallel",
    "nn",
    "optim",
    "process_local",
    "scatter_dataset",
    "scatter_index",
    "shard_optimizer",
    "skip_nonfinite",
    "train",
]
