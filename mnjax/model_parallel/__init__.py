"""Model parallelism: a model whose stages live on different ranks, and GPipe over them.

* `MultiNodeChain`: ChainerMN's ``MultiNodeChainList``, flax modules placed on ranks;
  ``micro_batches=M`` runs GPipe. Checkpoint with `mnjax.checkpoint.PerRankState`.
* `MultiNodeNStepRNN`: ChainerMN's multi-node N-step RNN, carries passed between ranks.
* `ChannelParallelConv`: channel-parallel convolution; `join_slices`, `slice_grads`.
* The schedule: `gpipe`, `programs`, `simulate`, `bubble_fraction`, `idle_fraction`.

Example::

    chain = mnjax.model_parallel.MultiNodeChain(comm, [(Encoder(), 0), (Head(), 1)])
    params = chain.init(jax.random.key(0), x)          # this rank's stages only
    grads = jax.grad(chain.loss)(params, x, y, loss_fn)  # on every rank, inside jit
"""

from mnjax.model_parallel._chain import MultiNodeChain
from mnjax.model_parallel._channel import ChannelParallelConv, join_slices, slice_grads
from mnjax.model_parallel._rnn import MultiNodeNStepRNN
from mnjax.model_parallel._schedule import (
    Action,
    Executed,
    ScheduleError,
    bubble_fraction,
    gpipe,
    idle_fraction,
    programs,
    simulate,
)

__all__ = [
    "Action",
    "ChannelParallelConv",
    "Executed",
    "MultiNodeChain",
    "MultiNodeNStepRNN",
    "ScheduleError",
    "bubble_fraction",
    "gpipe",
    "idle_fraction",
    "join_slices",
    "programs",
    "simulate",
    "slice_grads",
]
