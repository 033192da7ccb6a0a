"""Layer 2 — optax gradient transformations built on the in-step collectives.

* `allreduce_gradients`: each gradient becomes its mean over every device of every rank.
* `accumulate_gradients`: k micro-batches per update, one exchange per update.
* `skip_nonfinite`: an update with a NaN/Inf anywhere is skipped by every rank together;
  `raise_if_diverging` ends a run that keeps skipping.
* `dynamic_loss_scale`: float16 loss scaling (flax's ``DynamicScale``) on top of it: every
  rank skips and lowers the scale together; `loss_scale_state` reads the scale in the step.
* `recipes`: the large-batch recipes (Goyal et al., LARS, Akiba et al.'s RMSprop warm-up).

Example::

    tx = optax.chain(mnjax.optim.allreduce_gradients(comm), optax.sgd(0.1, momentum=0.9))
"""

from mnjax.optim import recipes
from mnjax.optim._accumulation import AccumulationState, accumulate_gradients
from mnjax.optim._allreduce import allreduce_gradients
from mnjax.optim._loss_scale import DynamicLossScaleState, dynamic_loss_scale, loss_scale_state
from mnjax.optim._nonfinite import (
    SkipNonFiniteState,
    all_finite,
    raise_if_diverging,
    skip_nonfinite,
)

__all__ = [
    "AccumulationState",
    "DynamicLossScaleState",
    "SkipNonFiniteState",
    "accumulate_gradients",
    "all_finite",
    "allreduce_gradients",
    "dynamic_loss_scale",
    "loss_scale_state",
    "raise_if_diverging",
    "recipes",
    "skip_nonfinite",
]
