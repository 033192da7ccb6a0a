"""Akiba et al.'s 15-minute ImageNet recipe (arXiv 1711.04325; docs/design/optim.md)."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.optim._linear_scaling import linear_scaling

__all__ = ["RmspropWarmupState", "akiba_blend", "rmsprop_warmup", "slow_start_schedule"]

# Slow start: the multiple of the linearly scaled rate from each epoch on.
SLOW_START_EPOCHS = (0, 40, 70, 85)
SLOW_START_FACTORS = (0.5, 0.075, 0.01, 0.001)


def _check_positive_int(name: str, where: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise ValueError(f"{where}: {name} must be a positive integer (optimizer steps per epoch:"
                     f" len(train) // global_batch_size), got {value!r}.")


def akiba_blend(steps_per_epoch: int, *, center: float = 10.0,
                period: float = 5.0) -> optax.Schedule:
  """SGD's share ``alpha_sgd`` of the `rmsprop_warmup` step, as a schedule of the step.

  With ``e = step / steps_per_epoch`` the fractional epoch, ``c = center``, ``p = period``::

    alpha_sgd(e) = 0.5 * exp(2 * (e - c) / p)   for e < c
                 = 0.5 + (e - c) / p            for c <= e < c + p / 2
                 = 1                            afterwards

  Args:
    steps_per_epoch: optimizer steps per epoch (> 0).
    center: ``c``, the epoch where SGD and RMSprop share the step equally (paper: 10).
    period: ``p``, in epochs, > 0 (paper: 5).

  Example:
    >>> alpha = akiba_blend(100)
    >>> [round(float(alpha(epoch * 100)), 4) for epoch in (0, 10, 11.25, 12.5, 20)]
    [0.0092, 0.5, 0.75, 1.0, 1.0]
  """
  _check_positive_int("steps_per_epoch", "akiba_blend", steps_per_epoch)
  if not period > 0:
    raise ValueError(f"akiba_blend: period must be > 0 epochs (the paper uses 5), got {period!r}.")
  center, period = float(center), float(period)

  def schedule(step):
    e = jnp.asarray(step, jnp.float32) / steps_per_epoch
    rise = 0.5 * jnp.exp(2.0 * jnp.minimum(e - center, 0.0) / period)  # no overflow past c
    line = 0.5 + (e - center) / period
    return jnp.where(e < center, rise, jnp.where(e < center + period / 2, line, 1.0))

  return schedule


def slow_start_schedule(global_batch_size: int, steps_per_epoch: int, *, base_lr: float = 0.1,
                        base_batch_size: int = 256) -> optax.Schedule:
  """Akiba et al.'s slow-start learning rate, an optax schedule of the step.

  ``eta_base = base_lr x global_batch_size / base_batch_size``, times 0.5 in epochs [0, 40),
  0.075 in [40, 70), 0.01 in [70, 85) and 0.001 from 85 on; epochs are whole.

  Args:
    global_batch_size: examples per step over all replicas.
    steps_per_epoch: optimizer steps per epoch (> 0).
    base_lr, base_batch_size: the reference rate and the batch it belongs to (> 0).

  Example:
    >>> eta = slow_start_schedule(32768, steps_per_epoch=39)
    >>> [round(float(eta(epoch * 39)), 5) for epoch in (0, 40, 70, 85)]
    [6.4, 0.96, 0.128, 0.0128]
  """
  _check_positive_int("steps_per_epoch", "slow_start_schedule", steps_per_epoch)
  if not base_lr > 0:
    raise ValueError(f"slow_start_schedule: base_lr must be > 0 (the paper: 0.1 per 256"
                     f" examples), got {base_lr!r}.")
  peak = linear_scaling(global_batch_size, base_lr, base_batch_size)
  boundaries = jnp.asarray([e * steps_per_epoch for e in SLOW_START_EPOCHS[1:]], jnp.int32)
  rates = jnp.asarray([peak * f for f in SLOW_START_FACTORS], jnp.float32)

  def schedule(step):
    return rates[jnp.searchsorted(boundaries, jnp.asarray(step, jnp.int32), side="right")]

  return schedule


class RmspropWarmupState(NamedTuple):
  """`rmsprop_warmup`'s state: step count, mean squared gradient ``m``, momentum ``Delta``."""

  count: jax.Array
  mean_square: Any
  delta: Any


def _check_rate(name: str, value: optax.ScalarOrSchedule) -> None:
  if not callable(value) and not value > 0:
    raise ValueError(f"rmsprop_warmup: {name} must be > 0 (a number or an optax schedule of"
                     f" positive rates), got {value!r}.")


def _as_schedule(value: optax.ScalarOrSchedule) -> optax.Schedule:
  return value if callable(value) else (lambda _: value)


def _check_unit(name: str, value: float, paper: float) -> None:
  if not 0.0 <= value < 1.0:
    raise ValueError(f"rmsprop_warmup: {name} must be in [0, 1) (Akiba et al.'s recipe: {paper}),"
                     f" got {value!r}.")


def rmsprop_warmup(learning_rate: optax.ScalarOrSchedule, sgd_fraction: optax.ScalarOrSchedule,
                   *, rmsprop_learning_rate: optax.ScalarOrSchedule = 3e-4,
                   momentum: float = 0.9, decay: float = 0.99,
                   eps: float = 1e-8) -> optax.GradientTransformation:
  """Akiba et al.'s RMSprop warm-up: momentum SGD whose step blends from RMSprop's into SGD's.

  With ``g`` the (allreduced) gradient, ``eta = learning_rate(t)``, ``eta_rmsprop =
  rmsprop_learning_rate(t)`` and ``alpha_sgd = sgd_fraction(t)``::

    alpha_rmsprop = (1 - alpha_sgd) * eta_rmsprop / eta
    m_t     = decay * m_{t-1} + (1 - decay) * g**2
    Delta_t = momentum * Delta_{t-1} - (alpha_sgd + alpha_rmsprop / (sqrt(m_t) + eps)) * g
    update  = eta * Delta_t

  ``alpha_sgd = 1`` is exactly ``optax.sgd(eta, momentum)``. Each rate is a number or a
  schedule; a schedule must itself give positive rates (``eta`` divides).

  Args:
    learning_rate: SGD's rate ``eta``, > 0 (`slow_start_schedule`).
    sgd_fraction: ``alpha_sgd`` in [0, 1] (`akiba_blend`).
    rmsprop_learning_rate: ``eta_rmsprop``, > 0 (recipe: 3e-4).
    momentum: ``mu1`` in [0, 1) (recipe: 0.9).
    decay: ``mu2``, the mean square's decay, in [0, 1) (recipe: 0.99).
    eps: added to ``sqrt(m_t)``, > 0 (recipe: 1e-8).

  Example:
    >>> steps = 39  # ImageNet's 1.28M images / 32768
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm),
    ...                  rmsprop_warmup(slow_start_schedule(32768, steps), akiba_blend(steps)))
    >>> rmsprop = rmsprop_warmup(6.4, 0.0)  # all RMSprop; no bias correction: 10 x eta_rmsprop
    >>> params = {"w": jnp.zeros(3)}
    >>> update, _ = rmsprop.update({"w": jnp.array([1.0, -10.0, 0.1])}, rmsprop.init(params))
    >>> np.round(np.asarray(update["w"]), 4)
    array([-0.003,  0.003, -0.003], dtype=float32)
  """
  _check_rate("learning_rate", learning_rate)
  _check_rate("rmsprop_learning_rate", rmsprop_learning_rate)
  if not callable(sgd_fraction) and not 0.0 <= sgd_fraction <= 1.0:
    raise ValueError(f"rmsprop_warmup: sgd_fraction must be in [0, 1] (a number or a schedule"
                     f" such as akiba_blend(steps_per_epoch)), got {sgd_fraction!r}.")
  _check_unit("momentum", momentum, 0.9)
  _check_unit("decay", decay, 0.99)
  if not eps > 0:
    raise ValueError(f"rmsprop_warmup: eps must be > 0 (Akiba et al.'s recipe: 1e-8), got {eps!r}.")
  eta_fn, eta_rms_fn, alpha_fn = map(_as_schedule,
                                     (learning_rate, rmsprop_learning_rate, sgd_fraction))

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return RmspropWarmupState(jnp.zeros((), jnp.int32), zeros, zeros)

  def update_fn(updates, state, params=None):
    del params
    eta, alpha_sgd = eta_fn(state.count), alpha_fn(state.count)
    alpha_rmsprop = (1 - alpha_sgd) * eta_rms_fn(state.count) / eta
    mean_square = jax.tree.map(lambda m, g: (decay * m + (1 - decay) * g * g).astype(m.dtype),
                               state.mean_square, updates)

    def step(d, g, m):
      return (momentum * d - (alpha_sgd + alpha_rmsprop / (jnp.sqrt(m) + eps)) * g).astype(
          d.dtype)

    delta = jax.tree.map(step, state.delta, updates, mean_square)
    new_updates = jax.tree.map(lambda d: (eta * d).astype(d.dtype), delta)
    return new_updates, RmspropWarmupState(state.count + 1, mean_square, delta)

  return optax.GradientTransformation(init_fn, update_fn)
