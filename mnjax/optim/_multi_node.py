"""ChainerMN's `create_multi_node_optimizer`: porting without touching the optimizer state."""

from __future__ import annotations

from typing import Any

import optax

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.optim._allreduce import allreduce_gradients, check_inner_update
from mnjax.optim._double_buffering import double_buffered_optimizer

__all__ = ["create_multi_node_optimizer"]

_CALLER = "create_multi_node_optimizer"


def create_multi_node_optimizer(actual_optimizer: optax.GradientTransformation, comm,
                                *, double_buffering: bool = False, **allreduce_options: Any,
                                ) -> optax.GradientTransformationExtraArgs:
  """`actual_optimizer` on the mean gradient over every replica, with its own state unchanged.

  ``init`` is ``actual_optimizer.init``, so a state saved by the original script restores into
  it; updates are bitwise those of ``optax.chain(allreduce_gradients(comm), actual_optimizer)``.

  Args:
    actual_optimizer: the original script's optax transformation; extra ``update`` arguments
      (e.g. ``value=`` for ``optax.contrib.reduce_on_plateau``) are passed on.
    double_buffering: run on the previous step's mean gradient (`DoubleBufferingState`).
    **allreduce_options: keywords of `allreduce_gradients`, checked now.

  Example:
    >>> tx = optax.sgd(optax.linear_schedule(0.1, 0.01, 100), momentum=0.9)
    >>> multi = mnjax.create_multi_node_optimizer(tx, comm, wire_dtype=jnp.bfloat16)
    >>> params = {"w": jnp.ones(3)}
    >>> jax.tree.structure(multi.init(params)) == jax.tree.structure(tx.init(params))
    True
    >>> updates, state = jax.jit(multi.update)({"w": jnp.ones(3)}, multi.init(params), params)
    >>> int(state[1].count)      # the schedule's count, where the old checkpoint keeps it
    1
  """
  if isinstance(actual_optimizer, Communicator):
    raise TypeError(
        f"{_CALLER}: the first argument is a Communicator; the order is {_CALLER}(tx, comm),"
        " the optimizer first as in ChainerMN (the arguments look swapped).")
  check_communicator(comm, _CALLER)
  if not (callable(getattr(actual_optimizer, "init", None))
          and callable(getattr(actual_optimizer, "update", None))):
    raise TypeError(
        f"{_CALLER}: actual_optimizer must be an optax GradientTransformation (with init and"
        f" update), got {type(actual_optimizer).__name__}; e.g."
        f" {_CALLER}(optax.sgd(0.1, momentum=0.9), comm).")
  if not isinstance(double_buffering, bool):
    raise TypeError(f"{_CALLER}: double_buffering must be a bool, got {double_buffering!r}.")
  if double_buffering:
    try:
      return double_buffered_optimizer(actual_optimizer, comm, **allreduce_options)
    except (TypeError, ValueError) as error:
      raise type(error)(f"{_CALLER}: {error}") from None
  try:
    reducer = allreduce_gradients(comm, **allreduce_options)
  except (TypeError, ValueError) as error:
    raise type(error)(f"{_CALLER}: {error}") from None
  inner = optax.with_extra_args_support(actual_optimizer)

  def init_fn(params):
    reducer.init(params)  # allreduce_gradients' dtype checks
    return inner.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    updates, _ = reducer.update(updates, optax.EmptyState(), params)
    check_inner_update(comm, _CALLER, inner, updates, state, params, extra_args)
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
