"""Layer 2 — optax gradient transformations built on the in-step collectives.

* `allreduce_gradients`: each gradient becomes its mean over every device of every rank.
* `create_multi_node_optimizer`: ChainerMN's wrapper: `tx` on the mean gradient, with `tx`'s
  own state (a ported script's checkpoints restore unchanged); ``double_buffering=True``
  runs `tx` on the previous step's gradient, first at the second step
  (`DoubleBufferingState`).
* `accumulate_gradients`: k micro-batches per update, one exchange per update.
* `skip_nonfinite`: an update with a NaN/Inf anywhere is skipped by every rank together;
  `raise_if_diverging` ends a run that keeps skipping.
* `dynamic_loss_scale`: float16 loss scaling (flax's ``DynamicScale``) on top of it: every
  rank skips and lowers the scale together; `loss_scale_state` reads the scale in the step.
* `local_sgd`: local SGD / DiLoCo: each replica steps alone, the replicas meet every k steps
  (one exchange per round; `LocalSGDState`); `meet_next_step` ends a round early.
* `shard_optimizer`: ZeRO-1, the optimizer state sharded over ranks (in place of the
  chain above); `gather_optimizer_state` / `scatter_optimizer_state` for checkpoints.
* `replace_inner_state`: a ported script's saved `tx` state put into a wrapper's state.
* `recipes`: the large-batch recipes (Goyal et al., LARS, Akiba et al.'s RMSprop warm-up).

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
