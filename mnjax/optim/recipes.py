"""Large-minibatch training recipes as ordinary optax objects.

* `linear_scaling`, `goyal_schedule`, `goyal_sgd`, `decay_mask`, `lars`: Goyal et al., LARS.
* `rmsprop_warmup`, `akiba_blend`, `slow_start_schedule`: Akiba et al.'s 15-minute ImageNet.
* `smoothed_cross_entropy`: label smoothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mnjax.optim._akiba import (
  RmspropWarmupState,
  akiba_blend,
  rmsprop_warmup,
  slow_start_schedule,
)
from mnjax.optim._linear_scaling import linear_scaling

__all__ = [
  "RmspropWarmupState",
  "akiba_blend",
  "decay_mask",
  "goyal_schedule",
  "goyal_sgd",
  "lars",
  "linear_scaling",
  "rmsprop_warmup",
  "slow_start_schedule",
  "smoothed_cross_entropy",
]


def goyal_schedule(global_batch_size: int, steps_per_epoch: int, *, base_lr: float = 0.1,
                   base_batch_size: int = 256, warmup_epochs: float = 5,
                   decay_epochs: Sequence[float] = (30, 60, 80), decay_factor: float = 0.1
                   ) -> optax.Schedule:
  """A schedule: gradual warmup from `base_lr` to the linearly scaled rate, then step decay.

  Args:
    global_batch_size: examples per step over all replicas.
    steps_per_epoch: ``len(train) // global_batch_size``.
    base_lr, base_batch_size: the reference rate and the batch it belongs to.
    warmup_epochs: epochs of linear warmup.
    decay_epochs: epochs at which the rate is multiplied by `decay_factor`.

  Example:
    >>> sched = goyal_schedule(8192, steps_per_epoch=156)
    >>> [round(float(sched(step)), 4) for step in (0, 5 * 156, 30 * 156)]
    [0.1, 3.2, 0.32]
  """
  if steps_per_epoch < 1:
    raise ValueError(f"goyal_schedule: steps_per_epoch must be >= 1, got {steps_per_epoch}.")
  peak = linear_scaling(global_batch_size, base_lr, base_batch_size)
  warmup_steps = int(round(warmup_epochs * steps_per_epoch))
  decay = optax.piecewise_constant_schedule(
      peak, {int(round(e * steps_per_epoch)) - warmup_steps: decay_factor for e in decay_epochs})
  if warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(base_lr, peak, warmup_steps)
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: kernels (2-D and up), not biases or BN scales.

  Example:
    >>> decay_mask({"conv": {"kernel": jnp.ones((3, 3, 1, 8)), "bias": jnp.ones(8)}})
    {'conv': {'bias': False, 'kernel': True}}
  """
  return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def goyal_sgd(global_batch_size: int, steps_per_epoch: int, *, momentum: float = 0.9,
              weight_decay: float = 1e-4, nesterov: bool = False, **schedule_kwargs
              ) -> optax.GradientTransformation:
  """Momentum SGD on `goyal_schedule` with weight decay on kernels only.

  Example:
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm), goyal_sgd(8192, 156))
  """
  schedule = goyal_schedule(global_batch_size, steps_per_epoch, **schedule_kwargs)
  return optax.chain(
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      optax.sgd(schedule, momentum=momentum, nesterov=nesterov),
  )


def lars(learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 1e-4,
         trust_coefficient: float = 0.001, momentum: float = 0.9) -> optax.GradientTransformation:
  """optax's LARS with decay and the layer-wise trust ratio on kernels only (`decay_mask`).

  Example:
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm), lars(goyal_schedule(32768, 39)))
  """
  return optax.lars(learning_rate, weight_decay=weight_decay, weight_decay_mask=decay_mask,
                    trust_coefficient=trust_coefficient, trust_ratio_mask=decay_mask,
                    momentum=momentum)


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array,
                           smoothing: float = 0.1) -> jax.Array:
  """Per-example cross-entropy against labels smoothed by `smoothing` (0: plain one-hot).

  Example:
    >>> smoothed_cross_entropy(jnp.zeros((2, 10)), jnp.array([1, 2])).shape
    (2,)
  """
  if not 0.0 <= smoothing < 1.0:
    raise ValueError(f"smoothed_cross_entropy: smoothing must be in [0, 1), got {smoothing}.")
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), smoothing)
  return optax.softmax_cross_entropy(logits, targets)
