"""What ranks compare about a tree before they exchange it, read locally (no communication)."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

__all__ = ["leaf_paths", "shares_in", "tree_containers", "tree_signature"]

#: The key `mnjax.optim.ShardedState` gives its one child (``.shard_<index>_of_<parts>``).
_SHARE_KEY = re.compile(r"\.shard_\d+_of_\d+")

def leaf_paths(tree: Any) -> list[str]:
  """Every leaf's path, in flattening order (``<root>`` for a tree that is one leaf).

  Example:
    >>> leaf_paths({"w": 1, "b": [2, 3]})
    ["['b'][0]", "['b'][1]", "['w']"]
  """
  return [jax.tree_util.keystr(path) or "<root>"
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def shares_in(tree: Any) -> list[str]:
  """The paths of `mnjax.shard_optimizer` states in `tree`, up to their (per-rank) share key.

  Example:
    >>> state = {"opt": mnjax.shard_optimizer(optax.adam(0.1), comm).init({"w": jnp.ones(3)})}
    >>> shares_in(state), shares_in({"w": jnp.ones(3)})
    (["['opt'].shard_0_of_1"], [])
  """
  found: list[str] = []
  for path in leaf_paths(tree):
    match = _SHARE_KEY.search(path)
    if match and path[:match.end()] not in found:
      found.append(path[:match.end()])
  return found


def tree_signature(tree: Any) -> tuple[tuple[str, tuple[int, ...], str], ...]:
  """``(leaf path, shape, dtype)`` for every leaf of `tree` (arrays or tracers), in order.

  Example:
    >>> tree_signature({"w": jnp.zeros((2, 3))})
    (("['w']", (2, 3), 'float32'),)
  """
  return tuple(
      (path, tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__)))
      for path, leaf in zip(leaf_paths(tree), jax.tree_util.tree_leaves(tree))
  )


def tree_containers(tree: Any) -> tuple[tuple[str, str], ...]:
  """``(path, container type)`` of every inner node, outermost first (tells lists from tuples).

  Example:
    >>> tree_containers({"b": [1, 2], "w": (3,)})
    (('<root>', 'dict'), ("['b']", 'list'), ("['w']", 'tuple'))
  """
  out: list[tuple[str, str]] = []

  def walk(node: Any, path: str) -> None:
    data = jax.tree_util.tree_structure(node).node_data()
    if data is None:  # a leaf
      return
    kind = data[0]
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")
    out.append((path or "<root>", name))
    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    for keys, child in children:
      walk(child, path + jax.tree_util.keystr(keys))

  walk(tree, "")
  return tuple(out)
