"""ChainerMN's double buffering: the optimizer runs on the previous step's gradient."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _buckets as bucketing
from mnjax.guard import _preflight as preflight
from mnjax.optim._allreduce import check_inner_update, gradient_exchange

__all__ = ["DoubleBufferingState", "PendingGradient", "check_pending", "double_buffered_optimizer",
           "double_buffered_update", "init_pending"]

_CALLER = "create_multi_node_optimizer"


class PendingGradient(NamedTuple):
  """The exchange's half of `DoubleBufferingState`.

  Attributes:
    pending: this rank's unreduced gradient of the previous step (zeros before the first).
    reduced: True when `mnjax.train.flush_pending` has replaced `pending` by its global sum.
  """

  pending: Any
  reduced: jax.Array


def init_pending(params: Any) -> PendingGradient:
  """A zero pending gradient shaped like `params` (what step 0 applies).

  Example:
    >>> init_pending({"w": jnp.ones(2)}).pending
    {'w': Array([0., 0.], dtype=float32)}
  """
  return PendingGradient(jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), bucketing.leaf_dtype(p)), params),
      jnp.zeros((), jnp.bool_))


def check_pending(updates: Any, state: Any, caller: str) -> None:
  """Raises unless `state` is a `PendingGradient` shaped like `updates` (tree, dtypes).

  Example:
    >>> check_pending({"w": jnp.ones(3)}, init_pending({"w": jnp.ones(2)}), "my_fn")
    Traceback (most recent call last):
    ValueError: my_fn: leaf ['w'] is float32[3] in the gradient but float32[2] ...
  """
  if not isinstance(state, PendingGradient):
    raise TypeError(
        f"{caller}: with double_buffering=True the exchange's state must be a PendingGradient"
        f" (from this transformation's init), got {type(state).__name__}. Build the optimizer"
        " state with tx.init(params) of the same transformation; a checkpoint written without"
        " double buffering cannot be resumed with it.")
  grads, _ = jax.tree_util.tree_flatten_with_path(updates)
  pending = jax.tree_util.tree_flatten_with_path(state.pending)[0]
  if jax.tree.structure(updates) != jax.tree.structure(state.pending):
    raise ValueError(
        f"{caller}: the gradient tree differs from the pending gradient's tree (the"
        f" parameters given to init): {len(grads)} leaves"
        f" {[jax.tree_util.keystr(p) for p, _ in grads][:4]}... vs {len(pending)} leaves"
        f" {[jax.tree_util.keystr(p) for p, _ in pending][:4]}.... Initialise the state with"
        " the parameters whose gradients the step passes.")
  for (path, g), (_, p) in zip(grads, pending):
    mine = (tuple(jnp.shape(g)), bucketing.leaf_dtype(g))
    held = (tuple(jnp.shape(p)), bucketing.leaf_dtype(p))
    if mine != held:
      raise ValueError(
          f"{caller}: leaf {jax.tree_util.keystr(path) or '<root>'} is"
          f" {mine[1]}{list(mine[0])} in the gradient but {held[1]}{list(held[0])} in the"
          " pending gradient of the state. Gradients must have their parameters' shapes and"
          " dtypes; initialise the state with the parameters being trained.")


def double_buffered_update(updates: Any, state: PendingGradient, comm: Communicator,
                           reduce: Callable[[Any], Any], *, mean: bool = True
                           ) -> tuple[Any, PendingGradient]:
  """``(reduce(state.pending), PendingGradient(updates))``; a flushed sum is not reduced again.

  Example:
    >>> state = init_pending({"w": jnp.ones(2)})
    >>> out, state = double_buffered_update({"w": jnp.ones(2)}, state, comm, lambda t: t)
    >>> out["w"].tolist(), state.pending["w"].tolist()      # step 0 applies zero
    ([0.0, 0.0], [1.0, 1.0])
  """
  exchanged = reduce(state.pending)
  replicas = comm.num_replicas

  def applied(exchanged, summed):  # a select: fuses with the update (no lax.cond copy)
    flushed = summed / jnp.asarray(replicas, summed.dtype) if mean else summed
    return jnp.where(state.reduced, flushed.astype(exchanged.dtype), exchanged)

  out = jax.tree.map(applied, exchanged, state.pending)
  stored = jax.tree.map(lambda g, p: jnp.asarray(g, p.dtype), updates, state.pending)
  return out, PendingGradient(stored, jnp.zeros((), jnp.bool_))


class DoubleBufferingState(NamedTuple):
  """State of ``create_multi_node_optimizer(tx, comm, double_buffering=True)``.

  Attributes:
    exchange: the pending gradient (`PendingGradient`).
    started: False until the first step has stored a gradient (that step applies zero).
    inner_state: the actual optimizer's state.
  """

  exchange: PendingGradient
  started: jax.Array
  inner_state: Any


def double_buffered_optimizer(tx: optax.GradientTransformation, comm: Communicator,
                              **allreduce_options: Any) -> optax.GradientTransformationExtraArgs:
  """`tx` on the previous step's mean gradient; step 0 applies zero. See `flush_pending`.

  Args:
    tx: the actual optimizer (extra ``update`` arguments are passed on to it).
    **allreduce_options: keywords of `mnjax.allreduce_gradients`, checked now.

  Example:
    >>> tx = mnjax.create_multi_node_optimizer(optax.adam(0.1), comm, double_buffering=True)
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
  exchange = gradient_exchange(comm, _CALLER, options={"double_buffering": True},
                               **allreduce_options)
  if comm.kind == "xla" and comm.local_device_count > 1:
    raise ValueError(
        f"{_CALLER}: double_buffering=True with the 'xla' kind needs one device per process,"
        f" but this process drives {comm.local_device_count}: between steps the xla kind"
        " keeps its replicated state from the first local device only, so the other"
        " devices' pending gradients would be lost. Run one process per device, or use"
        " 'hierarchical' or 'two_dimensional' (XLA's own scheduler already overlaps the xla"
        " kind's collectives with the backward pass).")
  inner = optax.with_extra_args_support(tx)

  def init_fn(params):
    exchange.check_params(params)
    return DoubleBufferingState(init_pending(params), jnp.zeros((), jnp.bool_),
                                inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, DoubleBufferingState):
      raise TypeError(
          f"{_CALLER}: with double_buffering=True the state must be a DoubleBufferingState"
          f" (from this transformation's init), got {type(state).__name__}. Build it with"
          " tx.init(params) of the same transformation; a state saved by tx alone holds no"
          " pending gradient and no first-step flag: restore it into the state's inner_state"
          " (docs/api.md, create_multi_node_optimizer).")
    pending = state.exchange
    # What travels is the pending tree: the ranks compare it too.
    exchange.check(updates, params, pending, **{"pending tree": (
        preflight.tree_signature(pending.pending) if isinstance(pending, PendingGradient)
        else type(pending).__name__)})
    check_pending(updates, pending, _CALLER)  # after the comparison: every rank raises alike
    # The pending gradient is the step's input, read again by the select of a flushed sum:
    # reduced into new buffers, XLA copies none of it.
    reduce = functools.partial(exchange.reduce, keep_inputs=True)
    previous, exchanged = double_buffered_update(updates, pending, comm, reduce,
                                                 mean=exchange.mean)
    check_inner_update(comm, _CALLER, inner, previous, state.inner_state, params, extra_args)
    new_updates, inner_state = inner.update(previous, state.inner_state, params, **extra_args)
    started = state.started
    new_updates = jax.tree.map(lambda u: jnp.where(started, u, jnp.zeros_like(u)), new_updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(started, new, old), inner_state,
                               state.inner_state)
    return new_updates, DoubleBufferingState(exchanged, jnp.ones((), jnp.bool_), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
