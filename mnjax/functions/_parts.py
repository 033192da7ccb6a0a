"""Per-rank shapes for `mnjax.functions`' collectives: parts padded to the largest one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.functions import _checks as checks

__all__ = ["Shape", "label", "pad", "part", "parts", "shape_of", "table", "width"]

Shape = tuple[int, ...]


def shape_of(shape: Any, caller: str, where: str) -> Shape:
  """`shape` as a tuple of non-negative ints, else a `ValueError` naming `where`.

  Example:
    >>> shape_of([2, 3], "allgather", "shapes[0]")
    (2, 3)
  """
  try:
    dims = tuple(shape)
  except TypeError:
    dims = None
  if dims is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                             and d >= 0 for d in dims):
    raise ValueError(f"mnjax.functions.{caller}: {where} must be a shape (a tuple of"
                     f" non-negative ints), got {shape!r}.")
  return tuple(int(d) for d in dims)


def table(shapes: Any, size: int, caller: str, *, square: bool = False) -> tuple:
  """`shapes` checked: ``size`` shapes, or with `square` ``size`` rows of ``size`` shapes.

  Example:
    >>> table([(2,), [3]], 2, "allgather")
    ((2,), (3,))
  """
  what = (f"a list of {size} rows of {size} shapes ([i][j]: the shape rank i sends to rank j)"
          if square else f"a list of {size} shapes (rank i's at index i)")
  if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or len(
      shapes) != size:
    raise ValueError(f"mnjax.functions.{caller}: shapes must be {what}, the same on every"
                     f" rank, got {shapes!r}.")
  if not square:
    return tuple(shape_of(s, caller, f"shapes[{i}]") for i, s in enumerate(shapes))
  for i, row in enumerate(shapes):
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != size:
      raise ValueError(f"mnjax.functions.{caller}: shapes must be {what}; row {i} is"
                       f" {row!r}.")
  return tuple(tuple(shape_of(s, caller, f"shapes[{i}][{j}]") for j, s in enumerate(row))
               for i, row in enumerate(shapes))


def part(x: Any, caller: str, name: str = "x", *, like: bool = False) -> Any:
  """`x` as an array MPI can move, maybe empty; `like`: a ``jax.ShapeDtypeStruct`` is allowed.

  Example:
    >>> part(jnp.zeros((0, 3)), "allgather").shape
    (0, 3)
  """
  if isinstance(x, jax.ShapeDtypeStruct) and not like:
    raise TypeError(f"mnjax.functions.{caller}: {name} must be an array (this rank's part),"
                    f" got a jax.ShapeDtypeStruct {x}.")
  x = x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x)
  checks.payload(jnp.zeros((1,), x.dtype), caller, name)  # the dtype check alone
  return x


def width(shapes: Sequence[Shape]) -> int:
  """Elements per padded slot: the largest part's, at least 1.

  Example:
    >>> width([(2, 3), (0,), (4,)])
    6
  """
  return max(1, *(math.prod(s) for s in shapes))


def pad(x: jax.Array, slot: int) -> jax.Array:
  """`x` flattened and zero-padded to `slot` elements.

  Example:
    >>> pad(jnp.ones((2,)), 3)
    Array([1., 1., 0.], dtype=float32)
  """
  flat = jnp.ravel(x)
  return jnp.pad(flat, (0, slot - flat.size))


def parts(slots: jax.Array, shapes: Sequence[Shape]) -> tuple[jax.Array, ...]:
  """Row i of `slots` cut to ``shapes[i]``.

  Example:
    >>> [p.shape for p in parts(jnp.zeros((2, 4)), [(2, 2), (3,)])]
    [(2, 2), (3,)]
  """
  return tuple(slots[i, :math.prod(s)].reshape(s) for i, s in enumerate(shapes))


def label(base: str, shapes: Any) -> str:
  """An exchange's label with its table: ranks that disagree on it do not pair.

  Example:
    >>> label("mnjax.functions.allgather", ((1,), (2,)))
    'mnjax.functions.allgather with per-rank shapes ((1,), (2,))'
  """
  return f"{base} with per-rank shapes {shapes}"
