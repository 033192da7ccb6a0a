"""Skip updates whose gradient holds a NaN or an Inf, on every rank together."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._host import _objects as objects
from mnjax.optim._shard_state import ShardedState

__all__ = ["SkipNonFiniteState", "all_finite", "raise_if_diverging", "skip_nonfinite"]


class SkipNonFiniteState(NamedTuple):
  """Counters of `skip_nonfinite`, plus the wrapped optimizer's state.

  Attributes:
    skipped: steps skipped since the start.
    consecutive: skips in a row up to the last step; 0 after a finite step.
    inner_state: the wrapped transformation's state, as of the last finite step.
  """

  skipped: jax.Array
  consecutive: jax.Array
  inner_state: Any


def all_finite(tree: Any) -> jax.Array:
  """A scalar bool: True when no leaf of `tree` holds a NaN or an Inf.

  Example:
    >>> all_finite({"w": jnp.array([1.0, jnp.nan])})
    Array(False, dtype=bool)
  """
  leaves = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def skip_nonfinite(inner: optax.GradientTransformation, *, on: str = "gradient"
                   ) -> optax.GradientTransformation:
  """Applies `inner` only when the (already reduced) gradient is finite; counts the skips.

  A skipped step returns zero updates and keeps `inner`'s state (`SkipNonFiniteState`).

  Args:
    inner: the transformation to protect (the optimizer after the allreduce).
    on: ``"gradient"`` (after `allreduce_gradients`), or ``"update"``: the update `inner`
      returns must be finite too (around `mnjax.shard_optimizer`, which needs it).

  Example:
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm),
    ...                  mnjax.skip_nonfinite(optax.sgd(0.1, momentum=0.9)))
    >>> params = {"w": jnp.ones(3)}
    >>> opt_state = tx.init(params)
    >>> updates, opt_state = tx.update({"w": jnp.full(3, jnp.inf)}, opt_state, params)
    >>> updates["w"].tolist(), int(opt_state[1].skipped)
    ([0.0, 0.0, 0.0], 1)
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "skip_nonfinite wraps an optax.GradientTransformation (e.g. optax.adam(1e-3)), got"
        f" {type(inner).__name__}.")
  if on not in ("gradient", "update"):
    raise ValueError(f"skip_nonfinite: on must be 'gradient' or 'update', got {on!r}.")

  def init_fn(params):
    zero = jnp.zeros((), jnp.int32)
    inner_state = inner.init(params)
    if on == "gradient" and any(isinstance(s, ShardedState) for s in jax.tree.leaves(
        inner_state, is_leaf=lambda x: isinstance(x, ShardedState))):
      raise ValueError(
          "skip_nonfinite: the optimizer it wraps is sharded (mnjax.shard_optimizer), so the"
          " gradient it sees is each rank's own, before the exchange, and ranks would skip"
          " different steps. Decide on the all-gathered update instead:"
          " skip_nonfinite(shard_optimizer(tx, comm), on='update').")
    return SkipNonFiniteState(zero, zero, inner_state)

  def update_fn(updates, state, params=None, **extra):
    new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
    finite = all_finite(updates) if on == "gradient" else all_finite(new_updates)
    # A select, not a lax.cond: XLA fuses it into the update (a cond copies its operands).
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
    inner_state = jax.tree.map(keep, inner_state, state.inner_state)
    skipped = state.skipped + (~finite).astype(jnp.int32)
    consecutive = jnp.where(finite, 0, state.consecutive + 1)
    return new_updates, SkipNonFiniteState(skipped, consecutive, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def raise_if_diverging(opt_state: Any, max_consecutive_skips: int, comm: Any = None) -> None:
  """Raises `FloatingPointError` when a `skip_nonfinite` in `opt_state` has skipped more than
  `max_consecutive_skips` steps in a row.

  Pass `comm` where each replica skips its own steps (inside `local_sgd`): all ranks then raise.

  Example:
    >>> tx = mnjax.skip_nonfinite(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> opt_state = tx.init(params)
    >>> _, opt_state = tx.update({"w": jnp.full(3, jnp.nan)}, opt_state, params)  # skipped
    >>> mnjax.optim.raise_if_diverging(opt_state, max_consecutive_skips=10)   # one skip: fine
    >>> mnjax.optim.raise_if_diverging(opt_state, max_consecutive_skips=0)
    Traceback (most recent call last):
    ...
    FloatingPointError: mnjax: 1 consecutive steps had non-finite (NaN or Inf) gradients ...

    In a training loop, check the previous step's state while the next one runs:

    >>> previous = state                                  # doctest: +SKIP
    >>> state, metrics = train_step(state, batch)         # doctest: +SKIP
    >>> mnjax.optim.raise_if_diverging(previous.opt_state, 10)  # doctest: +SKIP
  """
  if not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 0:
    raise ValueError("raise_if_diverging: max_consecutive_skips must be an int >= 0, got"
                     f" {max_consecutive_skips!r}.")
  leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SkipNonFiniteState))
  found = [s for s in leaves if isinstance(s, SkipNonFiniteState)]
  if not found:
    raise ValueError("raise_if_diverging: opt_state holds no skip_nonfinite state; wrap the"
                     " optimizer in mnjax.skip_nonfinite(...).")
  streak = max(int(s.consecutive) for s in found)
  if comm is not None:
    streak = max(objects.allgather_obj(streak, comm, operation="raise_if_diverging"))
  if streak > max_consecutive_skips:
    raise FloatingPointError(
        f"mnjax: {streak} consecutive steps had non-finite (NaN or Inf) gradients on some"
        f" rank, more than max_consecutive_skips={max_consecutive_skips}; the run is"
        " diverging. Lower the learning rate, enable loss scaling or gradient clipping, or"
        " check the input data; restart from the last checkpoint.")
