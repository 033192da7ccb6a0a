"""The restore template and the tree a checkpoint records: host copies, signatures, how a
template differs, and values handed back as the template's kinds of leaf."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._host._signature import tree_signature

__all__ = ["is_key", "like", "signature", "structure", "target", "template_difference",
           "to_host"]


def is_key(leaf: Any) -> bool:
  """Whether `leaf` is a typed PRNG key array (saved as its key data)."""
  return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def to_host(leaf: Any) -> np.ndarray:
  """A private host copy (the device buffer may be donated to the next step meanwhile)."""
  if is_key(leaf):
    leaf = jax.random.key_data(leaf)
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    leaf = leaf.addressable_shards[0].data  # replicated across processes
  return np.array(leaf, copy=True)


def like(value: np.ndarray, template: Any) -> Any:
  """`value` as the kind of leaf `template` is: numpy, key, or a jax array placed like it."""
  if is_key(template):
    return jax.random.wrap_key_data(value, impl=jax.random.key_impl(template))
  if isinstance(template, jax.Array):
    if not template.committed:  # free to follow the step's sharding, like a fresh array
      return jnp.asarray(value)
    if template.is_fully_addressable:
      return jax.device_put(value, template.sharding)
    return jax.make_array_from_callback(value.shape, template.sharding, lambda i: value[i])
  if isinstance(template, np.ndarray) or np.ndim(template):
    return value
  if isinstance(template, np.generic):  # its dtype, which the saved one safely casts to
    return value.astype(template.dtype)
  return value.item() if isinstance(template, (int, float, bool)) else value


def signature(host: Any) -> list[list[str]]:
  """``[path, shape, dtype]`` per leaf, as text (saved with each checkpoint, JSON)."""
  return [list(map(str, s)) for s in tree_signature(host)]


def structure(tree: Any) -> str:
  """The tree's containers with its leaves as ``*`` (saved with each checkpoint)."""
  text = str(jax.tree.structure(tree))
  return text[len("PyTreeDef("):-1] if text.startswith("PyTreeDef(") else text


def _short(text: str, limit: int = 160) -> str:
  return text if len(text) <= limit else text[:limit] + "..."


def template_difference(record: dict, template: Any) -> str:
  """How the tree `record` describes differs from `template` ('' if not): paths, shapes,
  dtypes (a Python scalar takes the saved dtype, a numpy scalar its own if safely cast)."""
  saved = record["signature"]
  leaves = jax.tree.leaves(template)
  # numpy leaves as they are: no copy of a whole sharded state's placeholders.
  expected = signature(jax.tree.map(
      lambda x: x if isinstance(x, np.ndarray) else to_host(x), template))
  saved_paths, paths = [s[0] for s in saved], [e[0] for e in expected]
  if saved_paths != paths:
    only_saved = [p for p in saved_paths if p not in set(paths)]
    only_template = [p for p in paths if p not in set(saved_paths)]
    text = f"the checkpoint has {len(saved)} leaves, the template {len(expected)}; " + (
        f"leaves only in the checkpoint {only_saved[:3]}, only in the template"
        f" {only_template[:3]}" if only_saved or only_template else "the same leaves in"
        " another order")
    saved_structure = record.get("structure")  # absent from older records
    return text + (f"; checkpoint {_short(saved_structure)}" if saved_structure else "") + (
        f"; template {_short(structure(template))}")
  diff = [f"{e[0]} saved as {s[2]}{s[1]}, template {e[2]}{e[1]}"
          for s, e, leaf in zip(saved, expected, leaves)
          if s[1] != e[1] or (s[2] != e[2] and _dtype_counts(leaf, s[2], e[2]))]
  return "; ".join(diff[:3]) + (f" (and {len(diff) - 3} more)" if len(diff) > 3 else "")


def _dtype_counts(leaf: Any, saved: str, expected: str) -> bool:
  """Whether a dtype difference counts: for arrays, for a numpy scalar not safely cast."""
  if isinstance(leaf, jax.Array) or np.ndim(leaf):
    return True
  if isinstance(leaf, np.generic):
    try:
      return not np.can_cast(np.dtype(saved), np.dtype(expected), casting="safe")
    except TypeError:  # a dtype numpy does not know by that name: compare the names
      return True
  return False


def target(template: Any, saved: list) -> Any:
  """Host buffers with the template's structure and the saved shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(template)
  if len(leaves) != len(saved):
    raise ValueError(f"it holds {len(saved)} leaves, the state {len(leaves)}")
  shapes = [np.shape(jax.random.key_data(x) if is_key(x) else x) for x in leaves]
  return jax.tree.unflatten(
      treedef, [np.zeros(shape, np.dtype(dtype)) for shape, (_, _, dtype) in zip(shapes, saved)])
