"""Optax gradient transformations built on the in-step collectives.

* `allreduce_gradients`: each gradient becomes its mean over every device of every rank.
* `create_multi_node_optimizer`: ChainerMN's wrapper, keeping `tx`'s own state.
* `accumulate_gradients`: k micro-batches per update, one exchange per update.
* `skip_nonfinite`, `raise_if_diverging`, `dynamic_loss_scale`, `loss_scale_state`: NaN/Inf
  steps skipped by every rank together; float16 loss scaling on top.
* `local_sgd`, `meet_next_step`: local SGD / DiLoCo, the replicas meet every k steps.
* `shard_optimizer`, `gather_optimizer_state`, `scatter_optimizer_state`: ZeRO-1.
* `replace_inner_state`: a ported script's saved `tx` state put into a wrapper's state.
* `recipes`: large-batch recipes (Goyal et al., LARS, Akiba et al.'s RMSprop warm-up).

Example::

    tx = optax.chain(mnjax.optim.allreduce_gradients(comm), optax.sgd(0.1, momentum=0.9))
"""

from mnjax.optim import recipes
from mnjax.optim._accumulation import AccumulationState, accumulate_gradients
from mnjax.optim._allreduce import allreduce_gradients
from mnjax.optim._double_buffering import DoubleBufferingState
from mnjax.optim._inner_state import replace_inner_state
from mnjax.optim._local_sgd import LocalSGDState, local_sgd, meet_next_step
from mnjax.optim._loss_scale import DynamicLossScaleState, dynamic_loss_scale, loss_scale_state
from mnjax.optim._multi_node import create_multi_node_optimizer
from mnjax.optim._nonfinite import (
    SkipNonFiniteState,
    all_finite,
    raise_if_diverging,
    skip_nonfinite,
)
from mnjax.optim._shard import shard_optimizer
from mnjax.optim._shard_state import ShardedState, gather_optimizer_state, scatter_optimizer_state

__all__ = [
    "AccumulationState",
    "DoubleBufferingState",
    "DynamicLossScaleState",
    "LocalSGDState",
    "ShardedState",
    "SkipNonFiniteState",
    "accumulate_gradients",
    "all_finite",
    "allreduce_gradients",
    "create_multi_node_optimizer",
    "dynamic_loss_scale",
    "gather_optimizer_state",
    "local_sgd",
    "loss_scale_state",
    "meet_next_step",
    "raise_if_diverging",
    "recipes",
    "replace_inner_state",
    "scatter_optimizer_state",
    "shard_optimizer",
    "skip_nonfinite",
]
