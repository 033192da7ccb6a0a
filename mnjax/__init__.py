"""mnjax: ChainerMN-style synchronous data-parallel training for JAX.

Gradient allreduce is an optax transformation; MPI (through mpi4jax) moves the gradients::

    import mnjax, optax
    comm = mnjax.create_communicator("flat")        # one MPI process per device
    params = mnjax.broadcast(params, comm, root=0)  # identical start on every rank
    tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))

Run the script with ``mpirun -n 4 python train.py`` (or ``srun``), or without a launcher
for a size-1 communicator.
"""

from mnjax import (
    accumulation, batch_norm, checkpoint, collectives, consensus, data, datasets, failfast,
    loop_checkpoints, metrics, native, nonfinite, preflight, recipes, topology, watchdog, wire,
    workdir)
from mnjax.accumulation import accumulate_gradients
from mnjax.batch_norm import SyncBatchNorm, allreduce_persistent
from mnjax.checkpoint import Checkpointer, CorruptCheckpointError
from mnjax.consensus import check_replicas
from mnjax.data import epoch_batches, local_batch_size, scatter_dataset, scatter_index
from mnjax.host_broadcast import broadcast
from mnjax.loop_checkpoints import LoopCheckpoints
from mnjax.metrics import allreduce_metrics, global_mean
from mnjax.nonfinite import raise_if_diverging, skip_nonfinite
from mnjax.parallel import data_parallel
from mnjax.topology import KINDS, Communicator, create_communicator
from mnjax.transforms import allreduce_gradients
from mnjax.watchdog import Watchdog

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "Communicator",
    "CorruptCheckpointError",
    "SyncBatchNorm",
    "KINDS",
    "LoopCheckpoints",
    "accumulate_gradients",
    "accumulation",
    "allreduce_persistent",
    "allreduce_gradients",
    "allreduce_metrics",
    "batch_norm",
    "broadcast",
    "check_replicas",
    "checkpoint",
    "consensus",
    "collectives",
    "create_communicator",
    "data_parallel",
    "data",
    "datasets",
    "epoch_batches",
    "failfast",
    "global_mean",
    "local_batch_size",
    "loop_checkpoints",
    "metrics",
    "native",
    "nonfinite",
    "preflight",
    "raise_if_diverging",
    "recipes",
    "scatter_dataset",
    "scatter_index",
    "skip_nonfinite",
    "topology",
    "watchdog",
    "Watchdog",
    "wire",
    "workdir",
]
