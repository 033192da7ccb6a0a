"""Skip updates whose gradient holds a NaN or an Inf — on every rank together.

One bad batch (a loss spike in mixed precision, a corrupt image) gives one rank a
non-finite gradient. After `allreduce_gradients` every rank holds the *same* sum, and a NaN
or Inf on any rank makes that sum non-finite too (IEEE: NaN + x = NaN, Inf + finite = Inf),
so each rank can decide locally and all decide alike: no extra message is needed, and the
replicas stay identical. Place `skip_nonfinite` *after* the allreduce, wrapping the
optimizer whose state must not see the bad gradient::

    tx = optax.chain(mnjax.allreduce_gradients(comm),
                     mnjax.skip_nonfinite(optax.adam(1e-3), max_consecutive_skips=10))

A skipped step leaves parameters and the wrapped optimizer's state untouched and counts the
skip. Unlike ``optax.apply_if_finite``, which after too many errors applies the bad update
anyway, ``max_consecutive_skips`` makes the step raise (`FloatingPointError`, on every
rank), because a run that only produces NaNs is lost.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import io_callback

__all__ = ["SkipNonFiniteState", "all_finite", "skip_nonfinite"]


class SkipNonFiniteState(NamedTuple):
  """Counters of `skip_nonfinite`, plus the wrapped optimizer's state.

  Attributes:
    skipped: steps skipped since the start (int32).
    consecutive: skips in a row up to the last step; 0 after a finite step (int32).
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


def _too_many(consecutive) -> None:
  raise FloatingPointError(
      f"mnjax.skip_nonfinite: {int(consecutive)} consecutive steps had non-finite (NaN or"
      " Inf) gradients on some rank, more than max_consecutive_skips allows; the run is"
      " diverging. Lower the learning rate, enable loss scaling or gradient clipping, or"
      " check the input data; restart from the last checkpoint.")


def skip_nonfinite(inner: optax.GradientTransformation, *,
                   max_consecutive_skips: int | None = None) -> optax.GradientTransformation:
  """Applies `inner` only when the (already reduced) gradient is finite; counts the skips.

  Args:
    inner: the transformation to protect (the optimizer after the allreduce).
    max_consecutive_skips: None (default) skips forever; an int K makes the K+1-th skip in
      a row raise `FloatingPointError` from the step (the same on every rank, since the
      counters are).

  Returns:
    An `optax.GradientTransformation` whose state is a `SkipNonFiniteState`. Skipped steps
    return zero updates.

  Example:
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm),
    ...                  mnjax.skip_nonfinite(optax.sgd(0.1, momentum=0.9)))
    >>> opt_state = tx.init(params)
    >>> int(opt_state[1].skipped)
    0
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "skip_nonfinite wraps an optax.GradientTransformation (e.g. optax.adam(1e-3)), got"
        f" {type(inner).__name__}.")
  if max_consecutive_skips is not None and (
      not isinstance(max_consecutive_skips, int) or isinstance(max_consecutive_skips, bool)
      or max_consecutive_skips < 0):
    raise ValueError(
        "skip_nonfinite: max_consecutive_skips must be None or an int >= 0, got"
        f" {max_consecutive_skips!r}.")

  def init_fn(params):
    zero = jnp.zeros((), jnp.int32)
    return SkipNonFiniteState(zero, zero, inner.init(params))

  def update_fn(updates, state, params=None, **extra):
    finite = all_finite(updates)

    def apply(_):
      new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
      return new_updates, inner_state

    def skip(_):
      return jax.tree.map(jnp.zeros_like, updates), state.inner_state

    new_updates, inner_state = jax.lax.cond(finite, apply, skip, None)
    consecutive = jnp.where(finite, 0, state.consecutive + 1)
    if max_consecutive_skips is not None:
      consecutive = jax.lax.cond(
          consecutive > max_consecutive_skips,
          lambda c: io_callback(_too_many, jax.ShapeDtypeStruct((), jnp.int32), c),
          lambda c: c, consecutive)
    skipped = state.skipped + (~finite).astype(jnp.int32)
    return new_updates, SkipNonFiniteState(skipped, consecutive, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)
