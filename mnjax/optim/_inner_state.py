"""Restoring a ported script's optimizer state into the state of an mnjax wrapper."""

from __future__ import annotations

from typing import Any

import jax

from mnjax.optim._shard_state import ShardedState

__all__ = ["replace_inner_state"]


def replace_inner_state(state: Any, inner: Any) -> Any:
  """`state` (e.g. ``wrapped.init(params)``) with the innermost optimizer's state replaced by
  `inner`, which must match it in tree, shapes and dtypes (momentum and counts carry over).

  Raises:
    TypeError: `state` is not a wrapper's state, is `shard_optimizer`'s (use
      `mnjax.optim.scatter_optimizer_state`), or `inner` does not match what it replaces.

  Example:
    >>> tx = optax.adam(0.1)
    >>> params = {"w": jnp.ones(2)}
    >>> adam, rest = tx.init(params)                  # as the original script saved it
    >>> saved = (adam._replace(count=jnp.asarray(3, jnp.int32)), rest)
    >>> wrapped = mnjax.create_multi_node_optimizer(tx, comm, double_buffering=True)
    >>> state = mnjax.optim.replace_inner_state(wrapped.init(params), saved)
    >>> int(state.inner_state[0].count)
    3
  """
  caller = "replace_inner_state"
  if isinstance(state, ShardedState):
    raise TypeError(
        f"{caller}: shard_optimizer's state holds shares of tx's state, not the whole of it;"
        " cut the restored state with mnjax.optim.scatter_optimizer_state(comm, tx,"
        " restored, params).")
  if not hasattr(state, "inner_state"):
    raise TypeError(
        f"{caller}: expected the state of an mnjax wrapper (a NamedTuple with an inner_state"
        " field: create_multi_node_optimizer(..., double_buffering=True), skip_nonfinite,"
        f" dynamic_loss_scale, accumulate_gradients), got {type(state).__name__}."
        " create_multi_node_optimizer(tx, comm) without double buffering has tx's own state:"
        " restore the saved state as it is.")
  return _replace(state, inner, caller, "state")


def _replace(state: Any, inner: Any, caller: str, where: str) -> Any:
  below = state.inner_state
  if hasattr(below, "inner_state") and not hasattr(inner, "inner_state"):
    return state._replace(inner_state=_replace(below, inner, caller, f"{where}.inner_state"))
  mine, theirs = jax.tree.structure(below), jax.tree.structure(inner)
  if mine != theirs:
    raise TypeError(
        f"{caller}: {where}.inner_state has the tree {mine}, but the state given has {theirs};"
        " pass the state of the optimizer the wrapper was built around (the original"
        " script's tx.init(params) tree, as restored).")
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(below)[0], jax.tree.leaves(inner)):
    got = (getattr(b, "shape", ()), getattr(b, "dtype", type(b)))
    want = (getattr(a, "shape", ()), getattr(a, "dtype", type(a)))
    if tuple(got[0]) != tuple(want[0]) or str(got[1]) != str(want[1]):
      raise TypeError(
          f"{caller}: leaf {jax.tree_util.keystr(path)} of {where}.inner_state is"
          f" {want[1]}{list(want[0])}, the state given has {got[1]}{list(got[0])}; restore"
          " it with the parameters the wrapper was initialised with.")
  return state._replace(inner_state=inner)
