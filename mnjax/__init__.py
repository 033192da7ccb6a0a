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
    accumulation, batch_norm, collectives, data, datasets, metrics, native, recipes, topology, wire, workdir)
from mnjax.accumulation import accumulate_gradients
from mnjax.batch_norm import SyncBatchNorm, allreduce_persistent
from mnjax.data import epoch_batches, local_batch_size, scatter_dataset, scatter_index
from mnjax.host_broadcast import broadcast
from mnjax.metrics import allreduce_metrics, global_mean
from mnjax.parallel import data_parallel
from mnjax.topology import KINDS, Communicator, create_communicator
from mnjax.transforms import allreduce_gradients

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "SyncBatchNorm",
    "KINDS",
    "accumulate_gradients",
    "accumulation",
    "allreduce_persistent",
    "allreduce_gradients",
    "allreduce_metrics",
    "batch_norm",
    "broadcast",
    "collectives",
    "create_communicator",
    "data_parallel",
    "data",
    "datasets",
    "epoch_batches",
    "global_mean",
    "local_batch_size",
    "metrics",
    "native",
    "recipes",
    "scatter_dataset",
    "scatter_index",
    "topology",
    "wire",
    "workdir",
]
