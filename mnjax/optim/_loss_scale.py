"""Dynamic loss scaling for float16 training, with one skip decision for every rank."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.optim._nonfinite import SkipNonFiniteState, skip_nonfinite

__all__ = ["DynamicLossScaleState", "dynamic_loss_scale", "loss_scale_state"]


class DynamicLossScaleState(NamedTuple):
  """The loss scale of `dynamic_loss_scale`, plus the wrapped optimizer's state.

  Attributes:
    scale: the float32 factor to multiply the loss by in the next step.
    good_steps: finite steps since the scale last changed.
    inner_state: a `SkipNonFiniteState` holding the wrapped optimizer's state.
  """

  scale: jax.Array
  good_steps: jax.Array
  inner_state: SkipNonFiniteState

  @property
  def finite(self) -> jax.Array:
    """True when the last update was applied (equal on every rank), e.g. to select BN stats."""
    return self.inner_state.consecutive == 0


def dynamic_loss_scale(inner: optax.GradientTransformation, *, initial_scale: float = 2.0**15,
                       growth_factor: float = 2.0, backoff_factor: float = 0.5,
                       growth_interval: int = 2000,
                       min_scale: float = 1.0) -> optax.GradientTransformation:
  """Unscales the (already reduced) gradient, applies `inner` if it is finite, adapts the scale.

  ``update`` takes the gradient of ``loss * scale`` (`loss_scale_state`); skipped steps give 0.

  Args:
    inner: the optimizer to protect (placed after `mnjax.allreduce_gradients`).
    initial_scale: the first loss scale.
    growth_factor: multiplies the scale after `growth_interval` finite steps in a row.
    backoff_factor: multiplies the scale after a non-finite step.
    growth_interval: finite steps in a row before the scale grows.
    min_scale: the scale never goes below it.

  Example:
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm),
    ...                  mnjax.optim.dynamic_loss_scale(optax.adam(1e-3)))
    >>> float(mnjax.optim.loss_scale_state(tx.init({"w": jnp.ones(3)})).scale)
    32768.0
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "dynamic_loss_scale wraps an optax.GradientTransformation (e.g. optax.adam(1e-3)),"
        f" got {type(inner).__name__}.")
  values = {"initial_scale": initial_scale, "growth_factor": growth_factor,
            "backoff_factor": backoff_factor, "min_scale": min_scale}
  for name, value in values.items():
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
      raise ValueError(f"dynamic_loss_scale: {name} must be a finite number, got {value!r}.")
  for name, ok, expected in [
      ("min_scale", min_scale > 0, "> 0"),
      ("initial_scale", initial_scale >= min_scale, f">= min_scale={min_scale}"),
      ("growth_factor", growth_factor >= 1, ">= 1"),
      ("backoff_factor", 0 < backoff_factor < 1, "in (0, 1)")]:
    if not ok:
      raise ValueError(f"dynamic_loss_scale: {name} must be {expected}, got {values[name]!r}.")
  if (not isinstance(growth_interval, int) or isinstance(growth_interval, bool)
      or growth_interval < 1):
    raise ValueError(f"dynamic_loss_scale: growth_interval must be an int >= 1, got"
                     f" {growth_interval!r}.")
  protected = skip_nonfinite(inner)

  def init_fn(params):
    return DynamicLossScaleState(jnp.asarray(initial_scale, jnp.float32),
                                 jnp.zeros((), jnp.int32), protected.init(params))

  def update_fn(updates, state, params=None, **extra):
    unscaled = jax.tree.map(lambda g: (g / state.scale).astype(g.dtype), updates)
    new_updates, inner_state = protected.update(unscaled, state.inner_state, params, **extra)
    finite = inner_state.consecutive == 0  # skip_nonfinite's decision, the same on every rank
    good = jnp.where(finite, state.good_steps + 1, 0)
    grown = state.scale * growth_factor
    grow = (good >= growth_interval) & jnp.isfinite(grown)
    scale = jnp.where(finite, jnp.where(grow, grown, state.scale),
                      jnp.maximum(state.scale * backoff_factor, min_scale))
    good = jnp.where(grow, 0, good)
    return new_updates, DynamicLossScaleState(scale, good, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def loss_scale_state(opt_state: Any) -> DynamicLossScaleState:
  """The `DynamicLossScaleState` inside `opt_state` (e.g. a chain's, a flax TrainState's).

  Traceable: read ``.scale`` before differentiating, ``.finite`` after ``tx.update``.

  Example:
    >>> tx, params = mnjax.optim.dynamic_loss_scale(optax.sgd(0.1)), {"w": jnp.ones(2)}
    >>> opt_state = tx.init(params)
    >>> scale = mnjax.optim.loss_scale_state(opt_state).scale
    >>> grads = jax.grad(lambda p: (p["w"] ** 2).sum() * scale)(params)
    >>> updates, opt_state = tx.update(grads, opt_state)
    >>> updates["w"], bool(mnjax.optim.loss_scale_state(opt_state).finite)
    (Array([-0.2, -0.2], dtype=float32), True)
  """
  found = [s for s in jax.tree.leaves(opt_state,
                                      is_leaf=lambda x: isinstance(x, DynamicLossScaleState))
           if isinstance(s, DynamicLossScaleState)]
  if len(found) != 1:
    raise ValueError(
        f"loss_scale_state: opt_state holds {len(found)} dynamic_loss_scale states, expected"
        " exactly one. Wrap the optimizer once, after the allreduce: optax.chain("
        "mnjax.allreduce_gradients(comm), mnjax.optim.dynamic_loss_scale(optimizer)).")
  return found[0]
