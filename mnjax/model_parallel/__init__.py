"""Model parallelism: a model whose stages live on different ranks, and GPipe over them.

* `MultiNodeChain`: ChainerMN's ``MultiNodeChainList`` as a chain of flax modules placed
  on ranks; activations cross ranks through `mnjax.functions` inside each rank's jitted
  step, each rank holds (and checkpoints, with `mnjax.checkpoint.PerRankState`) only its
  stages' parameters; ``micro_batches=M`` runs the GPipe schedule.
* `ChannelParallelConv`: ChainerMN's channel-parallel convolution (each rank holds a slice
  of the output channels, an in-step allgather joins them), `join_slices`, `slice_grads`.
* The schedule itself, pure Python: `gpipe` (the ideal timetable), `programs` (each rank's
  order), `simulate` (runs them with blocking sends: deadlocks named, idle time counted),
  `bubble_fraction` ((S - 1) / (M + S - 1)) and `idle_fraction`.

Example::

    chain = mnjax.model_parallel.MultiNodeChain(comm, [(Encoder(), 0), (Head(), 1)])
    params = chain.init(jax.random.key(0), x)          # this rank's stages only
    grads = jax.grad(chain.loss)(params, x, y, loss_fn)  # on every rank, inside jit
"""

from mnjax.model_parallel._chain import MultiNodeChain
from mnjax.model_parallel._channel import ChannelParallelConv, join_slices, slice_grads
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
    "ScheduleError",
    "bubble_fraction",
    "gpipe",
    "idle_fraction",
    "join_slices",
    "programs",
    "simulate",
    "slice_grads",
]
