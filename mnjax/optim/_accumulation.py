"""Gradient accumulation whose micro-steps communicate nothing (docs/design/optim.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._instep import _sequence as sequence

__all__ = ["AccumulationState", "accumulate_gradients"]


class AccumulationState(NamedTuple):
  """`micro_step` in [0, every_k); `grad_sum` of the micro-steps so far; the inner state."""

  micro_step: jax.Array
  grad_sum: Any
  inner_state: Any


def accumulate_gradients(inner: optax.GradientTransformation, every_k: int
                         ) -> optax.GradientTransformation:
  """Applies `inner` to the mean gradient of every `every_k` micro-steps; zero updates between.

  Args:
    inner: typically ``optax.chain(mnjax.allreduce_gradients(comm), optimizer)``.
    every_k: micro-steps per update (>= 1).

  Raises:
    ValueError: under the ``xla`` kind with several local devices per process (when traced),
      and from `mnjax.Checkpointer.save` inside a cycle with several replicas.

  Example:
    >>> tx = mnjax.accumulate_gradients(
    ...     optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)), every_k=4)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)  # in the jitted step
    >>> updates["w"].tolist(), int(state.micro_step)    # nothing until the 4th micro-step
    ([0.0, 0.0, 0.0], 1)
  """
  if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
    raise ValueError(
        f"accumulate_gradients: every_k must be an int >= 1 (micro-steps per update), got"
        f" {every_k!r}."
    )

  def init_fn(params):
    return AccumulationState(
        micro_step=jnp.zeros((), jnp.int32),
        grad_sum=jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params),
        inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None):
    if every_k > 1 and not sequence.per_device_state_kept():
      raise ValueError(
          "accumulate_gradients: this step runs under the 'xla' kind with several local"
          " devices per process, where data_parallel keeps only the first device's copy of"
          " the state between steps, so every other device's partial gradient sum would be"
          " lost (a silently wrong gradient). Use 'hierarchical' or 'two_dimensional', or one"
          " process per device.")
    grad_sum = jax.tree.map(jnp.add, state.grad_sum, updates)
    last = state.micro_step == every_k - 1

    def apply(grad_sum, inner_state):
      mean = jax.tree.map(lambda g, u: (g / every_k).astype(u.dtype), grad_sum, updates)
      new_updates, new_inner = inner.update(mean, inner_state, params)
      return new_updates, new_inner, jax.tree.map(jnp.zeros_like, grad_sum)

    def wait(grad_sum, inner_state):
      shapes = jax.eval_shape(lambda: inner.update(updates, inner_state, params)[0])
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      return zeros, inner_state, grad_sum

    # The pre-flight check compares every_k across ranks: another period would hang.
    with sequence.enclosing("accumulate_gradients", {"every_k": every_k}):
      new_updates, inner_state, grad_sum = jax.lax.cond(
          last, apply, wait, grad_sum, state.inner_state)
    micro_step = jnp.where(last, 0, state.micro_step + 1).astype(jnp.int32)
    return new_updates, AccumulationState(micro_step, grad_sum, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)
