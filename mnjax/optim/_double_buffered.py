"""ChainerMN's double-buffered optimizer, whose actual optimizer first runs at the second step.

ChainerMN's ``create_multi_node_optimizer(actual_optimizer, comm, double_buffering=True)``
starts the first step's exchange and updates nothing: its actual optimizer first runs at
the second step, on the first step's gradient (its ``t`` is 0 after step 1, 1 after step 2).
``optax.chain(mnjax.allreduce_gradients(comm, double_buffering=True), tx)`` cannot do that:
a chain's first link cannot keep the later ones from running, so at step 0 `tx` runs on a
zero gradient and stays one step ahead for good (Adam's count and bias correction, schedule
counts; weight decay applied once more).

`double_buffered_optimizer` wraps `tx` instead: the exchange is
``allreduce_gradients(comm, double_buffering=True, ...)`` itself (its checks, buckets, wire
dtype and overlap), and `tx` runs on what it returns from the second step on. At the first
step `tx`'s state is kept and the update is zero, decided by a flag of the state
(`DoubleBufferedState.started`), the same on every rank and device, with a select rather
than a ``lax.cond`` (as `mnjax.skip_nonfinite`: XLA fuses it into the update). The pending
gradient is a `DoubleBufferingState` inside it, so `mnjax.train.flush_pending` and
`mnjax.Checkpointer` treat it as they treat the chain form's; the flag is checkpointed with
it, so a resumed run does not skip a second first step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._communicator import Communicator
from mnjax.optim._allreduce import allreduce_gradients
from mnjax.optim._double_buffering import DoubleBufferingState

__all__ = ["DoubleBufferedState", "double_buffered_optimizer"]

_CALLER = "double_buffered_optimizer"


class DoubleBufferedState(NamedTuple):
  """State of `double_buffered_optimizer`.

  Attributes:
    exchange: the pending gradient (`DoubleBufferingState`) of the wrapped exchange.
    started: a bool scalar, False until the first step has stored a gradient: while it
      is False the step keeps `inner_state` and returns a zero update.
    inner_state: the actual optimizer's state (untouched by the first step).
  """

  exchange: DoubleBufferingState
  started: jax.Array
  inner_state: Any


def double_buffered_optimizer(tx: optax.GradientTransformation, comm: Communicator,
                              **allreduce_options: Any) -> optax.GradientTransformationExtraArgs:
  """`tx` applied to the previous step's mean gradient, first at the second step (ChainerMN's
  ``double_buffering=True``).

  Step ``t >= 1`` runs `tx` on the global mean gradient of step ``t - 1``, exchanged while
  step ``t`` computes (``allreduce_gradients(comm, double_buffering=True)``: module
  docstring of `mnjax.optim._double_buffering`); step 0 only stores its gradient, leaves
  `tx`'s state untouched and returns a zero update. Before a checkpoint, call
  `mnjax.train.flush_pending` on the state (`lab.runner.train_loop` does).

  Args:
    tx: the actual optimizer (any optax transformation; extra ``update`` arguments are
      passed on to it).
    comm: the `Communicator`.
    **allreduce_options: keywords of `allreduce_gradients` (``mean``, ``wire_dtype``,
      ``bucket_bytes``, ``preflight_timeout``), checked now.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `DoubleBufferedState`.

  Example:
    >>> tx = mnjax.optim.double_buffered_optimizer(optax.adam(0.1), comm)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> update = jax.jit(tx.update)
    >>> updates, state = update({"w": jnp.ones(2)}, state, params)     # stores, applies 0
    >>> updates["w"].tolist(), int(state.inner_state[0].count)
    ([0.0, 0.0], 0)
    >>> updates, state = update({"w": jnp.ones(2)}, state, params)     # Adam's first step
    >>> [round(u, 3) for u in updates["w"].tolist()], int(state.inner_state[0].count)
    ([-0.1, -0.1], 1)
  """
  if isinstance(tx, Communicator):
    raise TypeError(
        f"{_CALLER}: the first argument is a Communicator; the order is {_CALLER}(tx, comm),"
        " the optimizer first as in ChainerMN's create_multi_node_optimizer (the arguments"
        " look swapped).")
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(
        f"{_CALLER}: tx must be an optax GradientTransformation (with init and update), got"
        f" {type(tx).__name__}; e.g. {_CALLER}(optax.adam(1e-3), comm).")
  if "double_buffering" in allreduce_options:
    raise TypeError(
        f"{_CALLER}: it is always double-buffered; drop double_buffering="
        f"{allreduce_options['double_buffering']!r} (for the plain exchange use"
        " optax.chain(mnjax.allreduce_gradients(comm), tx)).")
  try:
    exchange = allreduce_gradients(comm, double_buffering=True, **allreduce_options)
  except (TypeError, ValueError) as error:
    raise type(error)(f"{_CALLER}: {error}") from None
  inner = optax.with_extra_args_support(tx)

  def init_fn(params):
    return DoubleBufferedState(exchange.init(params), jnp.zeros((), jnp.bool_),
                               inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, DoubleBufferedState):
      raise TypeError(
          f"{_CALLER}: the state must be a DoubleBufferedState (from this transformation's"
          f" init), got {type(state).__name__}. Build it with tx.init(params) of the same"
          " transformation; a state saved by tx alone or by a chain holds no pending"
          " gradient and no first-step flag.")
    previous, exchanged = exchange.update(updates, state.exchange, params)
    new_updates, inner_state = inner.update(previous, state.inner_state, params, **extra_args)
    started = state.started
    new_updates = jax.tree.map(lambda u: jnp.where(started, u, jnp.zeros_like(u)), new_updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(started, new, old), inner_state,
                               state.inner_state)
    return new_updates, DoubleBufferedState(exchanged, jnp.ones((), jnp.bool_), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
