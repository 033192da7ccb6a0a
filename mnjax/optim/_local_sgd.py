"""Local SGD and DiLoCo: replicas step alone and meet every k steps (docs/design/optim.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep._exact import _pow2
from mnjax.guard import _preflight as preflight
from mnjax.optim._allreduce import check_inner_update, gradient_exchange
from mnjax.optim._double_buffering import DoubleBufferingState, PendingGradient
from mnjax.optim._shard_state import ShardedState

__all__ = ["LocalSGDState", "agreed_target", "local_sgd", "meet", "meet_next_step"]

_CALLER = "local_sgd"


class LocalSGDState(NamedTuple):
  """The state of `local_sgd`.

  Attributes:
    steps_left: steps until the replicas meet (after the update of the step that finds 1).
    anchor: the parameters at the last meeting, the same on every replica: take
      ``params = state.anchor`` where bitwise identical replicas are needed (a checkpoint).
    outer_state: the outer optimizer's state (`optax.EmptyState` without one).
    inner_state: `tx`'s state, each replica's own.
    inexact: elements of this replica's parameters that missed the anchor at the last meeting.
  """

  steps_left: jax.Array
  anchor: Any
  outer_state: Any
  inner_state: Any
  inexact: jax.Array


def local_sgd(tx: optax.GradientTransformation, comm, *, every_k: int,
              outer: optax.GradientTransformation | None = None, wire_dtype: Any = None,
              bucket_bytes: int | str | None = "auto",
              preflight_timeout: float = preflight.DEFAULT_TIMEOUT,
              ) -> optax.GradientTransformation:
  """Local SGD (``outer=None``) or DiLoCo: `tx` on each replica's own gradient, and every
  `every_k` steps one exchange that brings the replicas to the same parameters.

  Args:
    tx: the inner optimizer, run on this replica's gradient (no `allreduce_gradients` in it).
    comm: the `Communicator` (one device per process; not ``replicas=``).
    every_k: steps per round (>= 1); ``every_k=1`` averages parameters after every step.
    outer: None: meet at the mean of the parameters; else an optax transformation given the
      mean change as gradient and the anchor as parameters (DiLoCo: Nesterov SGD).
    wire_dtype, bucket_bytes, preflight_timeout: as in `allreduce_gradients`.

  Returns:
    An `optax.GradientTransformation` with `LocalSGDState`; its ``update`` needs ``params``.

  Example:
    >>> tx = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=2)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grad = {"w": jnp.full(2, 1.0 + comm.rank)}                # each replica's own
    >>> step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    >>> updates, state = step(grad, state, params)               # step 1: local
    >>> params = optax.apply_updates(params, updates)
    >>> bool(jnp.allclose(params["w"], 1.0 - 0.1 * (1.0 + comm.rank)))
    True
    >>> updates, state = step(grad, state, params)               # step 2: the replicas meet
    >>> params = optax.apply_updates(params, updates)
    >>> mean = sum(1.0 + r for r in range(comm.size)) / comm.size
    >>> bool(abs(params["w"][0] - (1.0 - 0.2 * mean)) < 1e-6), int(state.steps_left)
    (True, 2)
    >>> bool(jnp.all(params["w"] == state.anchor["w"]))       # the same bits on every replica
    True
  """
  if isinstance(tx, Communicator):
    raise TypeError(f"{_CALLER}: the first argument is a Communicator; the order is"
                    f" {_CALLER}(tx, comm, every_k=...), the wrapped optimizer first as in optax.")
  _check_transformation(tx, "tx", "optax.adamw(1e-3)")
  check_communicator(comm, _CALLER)
  if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
    raise ValueError(f"{_CALLER}: every_k must be an int >= 1 (steps between the replicas'"
                     f" meetings), got {every_k!r}; e.g. every_k=8.")
  if outer is not None:
    _check_transformation(outer, "outer", "optax.sgd(0.7, momentum=0.9, nesterov=True)")
  if comm.exact:
    raise ValueError(
        f"{_CALLER}: this communicator runs {comm.num_replicas} replicas with exact sums"
        " (create_communicator(..., replicas=...)), where a process runs several replicas on"
        " one copy of the parameters; local steps need each replica's own copy. Drop"
        " replicas=, or train synchronously with allreduce_gradients.")
  if comm.local_device_count > 1:
    raise ValueError(
        f"{_CALLER}: this {comm.kind!r} communicator drives {comm.local_device_count} devices"
        " per process, and local_sgd keeps one model per process. Run one process per device"
        " (create_communicator('flat')), or allreduce_gradients within the node.")
  exchange = gradient_exchange(
      comm, _CALLER, mean=True, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes,
      preflight_timeout=preflight_timeout,
      options={"every_k": every_k, "outer": outer is not None})
  inner = optax.with_extra_args_support(tx)
  outer_inner = None if outer is None else optax.with_extra_args_support(outer)

  def init_fn(params):
    exchange.check_params(params)
    inner_state = inner.init(params)
    _refuse_exchanging_inner(inner_state)
    return LocalSGDState(
        steps_left=jnp.asarray(every_k, jnp.int32),
        anchor=jax.tree.map(jnp.array, params),  # a copy: a donated step may reuse params
        outer_state=optax.EmptyState() if outer is None else outer.init(params),
        inner_state=inner_state,
        inexact=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{_CALLER}: update needs params (the replicas move to a common"
                       " target, target - params): tx.update(grads, opt_state, params).")
    if not isinstance(state, LocalSGDState):
      raise TypeError(f"{_CALLER}: the state must be a LocalSGDState (from this"
                      f" transformation's init), got {type(state).__name__}.")
    exchange.check(updates, params, None)
    with sequence.enclosing(_CALLER, {"every_k": every_k}):  # an exchange inside: refused
      check_inner_update(comm, _CALLER, inner, updates, state.inner_state, params, extra_args)
      local_updates, inner_state = inner.update(updates, state.inner_state, params,
                                                **extra_args)
    if outer is not None:  # another outer optimizer on one rank: anchors that drift apart
      check_inner_update(comm, _CALLER, outer_inner, state.anchor, state.outer_state,
                         state.anchor, {})

    def meeting(operands):
      local_updates, outer_state = operands
      local = optax.apply_updates(params, local_updates)
      target, outer_state = meet(exchange.reduce, comm.num_replicas, params, local,
                                 state.anchor, outer, outer_state)
      new_updates = jax.tree.map(  # in float32 at least: a 16-bit parameter lands exactly
          lambda t, p, u: (t.astype(jnp.promote_types(p.dtype, jnp.float32))
                           - p.astype(jnp.promote_types(p.dtype, jnp.float32))).astype(u.dtype),
          target, params, local_updates)
      landed = jax.tree.map(lambda p, u, t: optax.apply_updates(p, u) == t,
                            params, new_updates, target)
      inexact = sum((jnp.sum(~x, dtype=jnp.int32) for x in jax.tree.leaves(landed)),
                    jnp.zeros((), jnp.int32))
      return new_updates, target, outer_state, inexact.astype(jnp.int32)

    def alone(operands):
      local_updates, outer_state = operands
      return local_updates, state.anchor, outer_state, state.inexact

    last = state.steps_left <= 1
    new_updates, anchor, outer_state, inexact = jax.lax.cond(
        last, meeting, alone, (local_updates, state.outer_state))
    steps_left = jnp.where(last, every_k, state.steps_left - 1).astype(jnp.int32)
    return new_updates, LocalSGDState(steps_left, anchor, outer_state, inner_state, inexact)

  return optax.GradientTransformation(init_fn, update_fn)


def meet_next_step(opt_state: Any) -> Any:
  """`opt_state` with every `LocalSGDState` set to meet at the next step; call on every rank.

  Example:
    >>> tx = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=8)
    >>> int(mnjax.optim.meet_next_step(tx.init({"w": jnp.ones(2)})).steps_left)
    1
  """
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
  if not found:
    raise ValueError("meet_next_step: opt_state holds no LocalSGDState (only"
                     " mnjax.optim.local_sgd(tx, comm, every_k=...) has one).")
  return jax.tree.map(
      lambda s: s._replace(steps_left=jnp.ones((), jnp.int32)) if _is_state(s) else s,
      opt_state, is_leaf=_is_state)


def _is_state(x: Any) -> bool:
  return isinstance(x, LocalSGDState)


def meet(reduce, replicas: int, params: Any, local: Any, anchor: Any,
         outer: optax.GradientTransformation | None, outer_state: Any) -> tuple[Any, Any]:
  """Common parameters and outer state after a meeting; `local`: `params` after this step.

  Example:
    >>> one = {"w": jnp.asarray([1.0, -2.0])}
    >>> target, _ = meet(lambda t: t, 1, one, one, one, None, optax.EmptyState())
    >>> target["w"].tolist()
    [1.0, -2.0]
  """
  change = jax.tree.map(lambda a, x: a - x, anchor, local)
  drift = [jnp.max(jnp.abs(p - a), initial=0.0).astype(jnp.float32)
           for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(anchor))]
  mean_change, mean_drift = reduce((change, drift))
  if outer is None:
    target = jax.tree.map(lambda a, c: a - c, anchor, mean_change)
  else:
    outer_updates, outer_state = outer.update(mean_change, outer_state, anchor)
    target = optax.apply_updates(anchor, outer_updates)
  leaves, treedef = jax.tree.flatten(target)
  # The mean of the drifts times the replica count is their sum, at least the largest.
  agreed = [agreed_target(t, a, d * replicas)
            for t, a, d in zip(leaves, jax.tree.leaves(anchor), mean_drift)]
  return jax.tree.unflatten(treedef, agreed), outer_state


def agreed_target(target: jax.Array, anchor: jax.Array, drift: jax.Array) -> jax.Array:
  """`target` rounded to two units in the last place of ``max(|anchor| + 2 drift, |target|)``.

  `drift` bounds every replica's ``|params - anchor|``. Other dtypes than float32: unchanged.

  Example:
    >>> float(agreed_target(jnp.float32(1e-8), jnp.float32(0.0), jnp.float32(1.0)))
    0.0
    >>> float(agreed_target(jnp.float32(0.75), jnp.float32(0.5), jnp.float32(0.25)))
    0.75
  """
  if target.dtype != jnp.float32:
    return target
  scale = jnp.maximum(jnp.abs(anchor) + 2 * drift, jnp.abs(target))
  _, exponent = jnp.frexp(scale)  # scale in [2**(e-1), 2**e): two ulps are 2**(e-23)
  grid = _pow2(jnp.clip(exponent - 23, -126, 127))
  usable = (scale > 0) & jnp.isfinite(scale) & (exponent - 23 >= -126)
  return jnp.where(usable, jnp.round(target / grid) * grid, target)


def _check_transformation(candidate: Any, name: str, example: str) -> None:
  if not (callable(getattr(candidate, "init", None))
          and callable(getattr(candidate, "update", None))):
    raise TypeError(f"{_CALLER}: {name} must be an optax GradientTransformation (with init and"
                    f" update), got {type(candidate).__name__}; e.g. {name}={example}.")


def _refuse_exchanging_inner(inner_state: Any) -> None:
  """Raises if `tx` exchanges gradients itself (shard_optimizer, double buffering)."""
  kinds = (ShardedState, PendingGradient, DoubleBufferingState)
  found = [type(s).__name__ for s in jax.tree.leaves(
      inner_state, is_leaf=lambda x: isinstance(x, kinds)) if isinstance(s, kinds)]
  if found:
    raise ValueError(
        f"{_CALLER}: tx exchanges gradients every step itself (its state holds a {found[0]}:"
        " shard_optimizer or double buffering), which local SGD exists to avoid. Pass the"
        " plain optimizer, e.g. local_sgd(optax.adamw(1e-3), comm, every_k=8).")
