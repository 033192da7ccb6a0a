"""Pytrees between ranks inside a step, leaf by leaf; one delegate carries every backward."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mnjax.comm._communicator import Communicator

__all__ = ["connected", "recv_tree", "send_tree", "spec"]


def _functions() -> Any:
  """`mnjax.functions`, imported when a message is traced."""
  from mnjax import functions  # noqa: PLC0415
  return functions


def spec(x: Any) -> Any:
  """`x`'s shapes and dtypes, leaf by leaf.

  Example:
    >>> spec((jnp.ones(2), jnp.int32(1)))
    (ShapeDtypeStruct(shape=(2,), dtype=float32), ShapeDtypeStruct(shape=(), dtype=int32))
  """
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)


def connected(delegate: Any, tree: Any) -> Any:
  """`tree`'s float leaves made to depend on `delegate` (if any).

  Example:
    >>> connected(jnp.zeros(()), {"h": jnp.ones(2)})["h"]
    Array([1., 1.], dtype=float32)
  """
  leaves, treedef = jax.tree.flatten(tree)
  floats = [i for i, leaf in enumerate(leaves)
            if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  if delegate is None or not floats:
    return tree
  out = _functions().pseudo_connect(delegate, *(leaves[i] for i in floats))
  for i, leaf in zip(floats, out if len(floats) > 1 else (out,), strict=True):
    leaves[i] = leaf
  return jax.tree.unflatten(treedef, leaves)


def send_tree(tree: Any, comm: Communicator, dest: int, delegate: Any = None) -> Any:
  """Sends `tree` leaf by leaf to `dest`; returns the last delegate, joined to every earlier one.

  Example:
    >>> send_tree((h, c), comm, 1)            # rank 0 of two; rank 1 recv_tree  # doctest: +SKIP
  """
  for leaf in jax.tree.leaves(tree):
    sent = _functions().send(connected(delegate, leaf), comm, dest)
    delegate = sent if delegate is None else connected(delegate, sent)
  return delegate


def recv_tree(like: Any, comm: Communicator, source: int, delegate: Any = None) -> Any:
  """A tree like `like`, leaf by leaf from `source`, each joined to `delegate`.

  Example:
    >>> recv_tree(spec((h, c)), comm, 0)      # rank 1 of two; rank 0 send_tree  # doctest: +SKIP
  """
  return jax.tree.map(
      lambda s: connected(delegate, _functions().recv(comm, source, s)), like)
