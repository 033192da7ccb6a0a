"""Differentiable collectives inside a jitted step: ChainerMN's bcast, gather, scatter,
allgather and alltoall. Stacked values have a leading axis of one row per rank.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep._primitives import sum_dtype
from mnjax.functions import _chain as chain
from mnjax.functions import _checks as checks
from mnjax.functions import _parts as parts
from mnjax.functions._transport import issue

__all__ = ["allgather", "alltoall", "bcast", "gather", "scatter"]


def bcast(x: Any, comm: Communicator, root: int = 0) -> jax.Array:
  """Rank `root`'s `x` on every rank; backward: the gradients summed to the root.

  Non-roots pass an array or ``jax.ShapeDtypeStruct`` of the root's shape and dtype.

  Example:
    >>> mnjax.functions.bcast(jnp.arange(3.0), comm, 0)
    Array([0., 1., 2.], dtype=float32)
  """
  comm = checks.communicator(comm, "bcast")
  spec, x = _operand(x, comm, root, "bcast")
  if not checks.checked(root, comm, "root", "bcast", peer=False):
    return jnp.zeros(spec.shape, spec.dtype)
  if comm.size == 1:
    return x
  root = int(root)
  x = x if comm.rank == root else _differentiable(x)
  forward = functools.partial(_bcast, comm, root, spec)
  backward = functools.partial(_bcast_backward, comm, root, spec, x is not None)
  return chain.apply(forward, backward, x, spec.dtype, comm, "bcast")


def gather(x: Any, comm: Communicator, root: int = 0, *, shapes: Any = None) -> Any:
  """Every rank's `x` stacked on rank `root`; elsewhere a delegate (as `send` returns).

  With ``shapes`` (rank i's shape at i, the same on every rank), the root gets a tuple of parts.
  Backward: a scatter from the root.

  Example:
    >>> mnjax.functions.gather(jnp.ones(2), comm, 0).shape
    (1, 2)
    >>> [p.shape for p in mnjax.functions.gather(jnp.ones(2), comm, 0, shapes=[(2,)])]
    [(2,)]
  """
  comm = checks.communicator(comm, "gather")
  if shapes is not None:
    return _gather_parts(x, comm, root, parts.table(shapes, comm.size, "gather"))
  x = checks.payload(x, "gather")
  if not checks.checked(root, comm, "root", "gather", peer=False):
    return (jnp.zeros((comm.size, *x.shape), x.dtype) if comm.rank == root
            else jnp.zeros((), jnp.float32))
  if comm.size == 1:
    return x[None]
  root = int(root)
  forward = functools.partial(_gather, comm, root, "mnjax.functions.gather", "forward")
  backward = functools.partial(_gather_backward, comm, root, x.shape, x.dtype)
  return chain.apply(forward, backward, x, x.dtype, comm, "gather")


def scatter(xs: Any, comm: Communicator, root: int = 0) -> jax.Array:
  """Row ``comm.rank`` of rank `root`'s stacked `xs`; backward: a gather to the root.

  The root may pass a list of ``comm.size`` parts of any shapes (rank i gets part i). The
  others pass an array or ``jax.ShapeDtypeStruct`` (or a list of them) of the same shapes.

  Example:
    >>> mnjax.functions.scatter(jnp.arange(2.0 * comm.size).reshape(comm.size, 2), comm, 0)
    Array([0., 1.], dtype=float32)
    >>> mnjax.functions.scatter([jnp.arange(3.0)] * comm.size, comm, 0)
    Array([0., 1., 2.], dtype=float32)
  """
  comm = checks.communicator(comm, "scatter")
  if isinstance(xs, (list, tuple)):
    return _scatter_parts(xs, comm, root)
  spec, xs = _operand(xs, comm, root, "scatter", name="xs")
  rows = _rows(spec.shape, comm, "scatter", "xs")
  if rows is None or not checks.checked(root, comm, "root", "scatter", peer=False):
    return jnp.zeros(spec.shape[1:], spec.dtype)
  if comm.size == 1:
    return xs[0]
  root = int(root)
  xs = xs if comm.rank == root else _differentiable(xs)
  forward = functools.partial(_scatter, comm, root, spec, "mnjax.functions.scatter", "forward")
  backward = functools.partial(_scatter_backward, comm, root, spec, xs is not None)
  return chain.apply(forward, backward, xs, spec.dtype, comm, "scatter")


def allgather(x: Any, comm: Communicator, *, shapes: Any = None) -> Any:
  """Every rank's `x` stacked on every rank; with ``shapes``, a tuple of parts.

  Example:
    >>> mnjax.functions.allgather(jnp.ones(2), comm).shape == (comm.size, 2)
    True
    >>> shapes = [(r + 1,) for r in range(comm.size)]            # rank r has r + 1 items
    >>> [p.shape for p in mnjax.functions.allgather(jnp.ones(comm.rank + 1), comm,
    ...                                             shapes=shapes)]
    [(1,)]
  """
  comm = checks.communicator(comm, "allgather")
  if shapes is not None:
    return _allgather_parts(x, comm, parts.table(shapes, comm.size, "allgather"))
  x = checks.payload(x, "allgather")
  if comm.size == 1:
    return x[None]
  forward = functools.partial(_allgather, comm, "mnjax.functions.allgather")
  backward = functools.partial(_allgather_backward, comm)
  return chain.apply(forward, backward, x, x.dtype, comm, "allgather")


def alltoall(xs: Any, comm: Communicator, *, shapes: Any = None) -> Any:
  """Row ``j`` of `xs` goes to rank ``j``; row ``i`` of the result came from rank ``i``.

  With ``shapes`` (``shapes[i][j]``: the shape rank i sends to rank j, the same on every
  rank), `xs` and the result are lists of parts.

  Example:
    >>> xs = jnp.arange(2.0 * comm.size).reshape(comm.size, 2)
    >>> bool((mnjax.functions.alltoall(xs, comm)[comm.rank] == xs[comm.rank]).all())
    True
    >>> mnjax.functions.alltoall([jnp.ones(3)], comm, shapes=[[(3,)]])[0].shape
    (3,)
  """
  comm = checks.communicator(comm, "alltoall")
  if shapes is not None:
    return _alltoall_parts(xs, comm, parts.table(shapes, comm.size, "alltoall", square=True))
  xs = checks.payload(xs, "alltoall", "xs")
  if _rows(xs.shape, comm, "alltoall", "xs") is None:
    return jnp.zeros_like(xs)
  if comm.size == 1:
    return xs
  forward = functools.partial(_alltoall, comm, "mnjax.functions.alltoall")
  backward = functools.partial(_alltoall_backward, comm)
  return chain.apply(forward, backward, xs, xs.dtype, comm, "alltoall")


def _operand(x: Any, comm: Communicator, root: Any, caller: str,
             name: str = "x") -> tuple[jax.ShapeDtypeStruct, jax.Array | None]:
  """The shape every rank passes, and the array (None where only a shape came)."""
  if comm.rank == root or isinstance(x, (jax.Array, list, tuple, float, int)) or hasattr(
      x, "__array__"):
    x = checks.payload(x, caller, name)
    return jax.ShapeDtypeStruct(x.shape, x.dtype), x
  return checks.like_spec(x, caller, name), None


def _differentiable(x: jax.Array | None) -> jax.Array | None:
  """A non-root's array if inexact (it gets a zero gradient), else None."""
  return x if x is not None and jnp.issubdtype(x.dtype, jnp.inexact) else None


def _rows(shape: tuple, comm: Communicator, caller: str, name: str) -> int | None:
  """``comm.size``, or None (refused) when `shape`'s leading axis is not one row per rank."""
  if shape and shape[0] == comm.size:
    return comm.size
  checks.refuse(f"mnjax.functions.{caller}: {name} must have a leading axis of one row per"
                f" rank ({comm.size}), got shape {tuple(shape)}", comm)
  return None


def _note(shape: tuple, dtype: Any) -> tuple:
  """A collective's sequence entry: every member notes the same shape and dtype."""
  return ("collective", None, None, tuple(shape), str(jax.numpy.dtype(dtype)))


def _fits(shape: tuple, want: tuple, comm: Communicator, caller: str, name: str) -> bool:
  """Whether this rank's part has its entry of the table; else the call is refused."""
  if tuple(shape) == tuple(want):
    return True
  checks.refuse(f"mnjax.functions.{caller}: rank {comm.rank}'s {name} has shape"
                f" {tuple(shape)}, but the shapes table gives it {tuple(want)}; pass each"
                " rank's part in the shape its entry of the table names", comm)
  return False


def _one_dtype(xs: list, caller: str) -> Any:
  dtypes = {jnp.dtype(p.dtype) for p in xs}
  if len(dtypes) != 1:
    raise TypeError(f"mnjax.functions.{caller}: the parts have dtypes"
                    f" {sorted(map(str, dtypes))}; pass parts of one dtype.")
  return dtypes.pop()


def _part_list(xs: Any, comm: Communicator, caller: str, *, like: bool = False) -> list:
  if not isinstance(xs, (list, tuple)) or len(xs) != comm.size:
    raise ValueError(f"mnjax.functions.{caller}: xs must be a list of {comm.size} parts"
                     f" (part i for rank i), got {type(xs).__name__} of"
                     f" {len(xs) if isinstance(xs, (list, tuple)) else 'no'} parts.")
  return [parts.part(p, caller, f"xs[{i}]", like=like) for i, p in enumerate(xs)]


def _allgather_parts(x: Any, comm: Communicator, shapes: tuple) -> tuple:
  x = parts.part(x, "allgather")
  if not _fits(x.shape, shapes[comm.rank], comm, "allgather", "x"):
    return tuple(jnp.zeros(s, x.dtype) for s in shapes)
  if comm.size == 1:
    return (x,)
  slot = parts.pad(x, parts.width(shapes))
  forward = functools.partial(_allgather, comm,
                              parts.label("mnjax.functions.allgather", shapes))
  backward = functools.partial(_allgather_backward, comm)
  return parts.parts(chain.apply(forward, backward, slot, slot.dtype, comm, "allgather"),
                     shapes)


def _gather_parts(x: Any, comm: Communicator, root: Any, shapes: tuple) -> Any:
  x = parts.part(x, "gather")
  if not (checks.checked(root, comm, "root", "gather", peer=False)
          and _fits(x.shape, shapes[comm.rank], comm, "gather", "x")):
    return (tuple(jnp.zeros(s, x.dtype) for s in shapes) if comm.rank == root
            else jnp.zeros((), jnp.float32))
  if comm.size == 1:
    return (x,)
  root, slot = int(root), parts.pad(x, parts.width(shapes))
  forward = functools.partial(_gather, comm, root,
                              parts.label("mnjax.functions.gather", shapes), "forward")
  backward = functools.partial(_gather_backward, comm, root, slot.shape, slot.dtype)
  out = chain.apply(forward, backward, slot, slot.dtype, comm, "gather")
  return parts.parts(out, shapes) if comm.rank == root else out


def _scatter_parts(xs: Any, comm: Communicator, root: Any) -> jax.Array:
  xs = _part_list(xs, comm, "scatter", like=True)
  dtype, shapes = _one_dtype(xs, "scatter"), tuple(tuple(p.shape) for p in xs)
  mine = shapes[comm.rank]
  arrays = not any(isinstance(p, jax.ShapeDtypeStruct) for p in xs)
  if not checks.checked(root, comm, "root", "scatter", peer=False):
    return jnp.zeros(mine, dtype)
  if comm.rank == root and not arrays:
    checks.refuse("mnjax.functions.scatter: the root passed shapes (jax.ShapeDtypeStruct)"
                  " among its parts; the root passes the arrays it hands out", comm)
    return jnp.zeros(mine, dtype)
  if comm.size == 1:
    return xs[0]
  root, slot = int(root), parts.width(shapes)
  spec = jax.ShapeDtypeStruct((comm.size, slot), dtype)
  stacked = jnp.stack([parts.pad(p, slot) for p in xs]) if arrays else None
  stacked = stacked if comm.rank == root else _differentiable(stacked)
  forward = functools.partial(_scatter, comm, root, spec,
                              parts.label("mnjax.functions.scatter", shapes), "forward")
  backward = functools.partial(_scatter_backward, comm, root, spec, stacked is not None)
  out = chain.apply(forward, backward, stacked, dtype, comm, "scatter")
  return out[:math.prod(mine)].reshape(mine)


def _alltoall_parts(xs: Any, comm: Communicator, shapes: tuple) -> tuple:
  xs = _part_list(xs, comm, "alltoall")
  dtype, n, me = _one_dtype(xs, "alltoall"), comm.size, comm.rank
  incoming = [shapes[i][me] for i in range(n)]
  if not _fits(tuple(tuple(p.shape) for p in xs), shapes[me], comm, "alltoall", "parts"):
    return tuple(jnp.zeros(s, dtype) for s in incoming)
  if n == 1:
    return (xs[0],)
  slot = parts.width([s for row in shapes for s in row])
  stacked = jnp.stack([parts.pad(p, slot) for p in xs])
  forward = functools.partial(_alltoall, comm, parts.label("mnjax.functions.alltoall", shapes))
  backward = functools.partial(_alltoall_backward, comm)
  return parts.parts(chain.apply(forward, backward, stacked, dtype, comm, "alltoall"),
                     incoming)


def _bcast(comm, root, spec, x, after):
  operand = x if comm.rank == root else jnp.zeros(spec.shape, spec.dtype)
  label = f"mnjax.functions.bcast from root {root}"
  return issue("bcast", comm, operand, after, shape=spec.shape, dtype=spec.dtype,
               count=math.prod(spec.shape), label=label,
               note=_note(spec.shape, spec.dtype), root=root)


def _bcast_backward(comm, root, spec, had_x, ct, after):
  wide = sum_dtype(spec.dtype)
  label = f"mnjax.functions.bcast's backward (sum to root {root})"
  shape = spec.shape if comm.rank == root else (1,)
  total = issue("reduce", comm, ct.astype(wide), after, shape=shape, dtype=wide,
                count=math.prod(spec.shape), label=label, note=_note(spec.shape, wide),
                root=root, op=0)
  if comm.rank == root:
    return total.astype(spec.dtype), total
  return (jnp.zeros(spec.shape, spec.dtype) if had_x else None), total


def _gather(comm, root, label, phase, x, after):
  del phase
  shape = (comm.size, *x.shape) if comm.rank == root else (1,)
  out = issue("gather", comm, x, after, shape=shape, dtype=x.dtype, count=x.size, label=label,
              note=_note(x.shape, x.dtype), root=root)
  return out if comm.rank == root else out.reshape(()).astype(jnp.float32)


def _gather_backward(comm, root, shape, dtype, ct, after):
  spec = jax.ShapeDtypeStruct((comm.size, *shape), dtype)
  grad = _scatter(comm, root, spec, f"mnjax.functions.gather's backward (scatter from root"
                  f" {root})", "gradient", ct if comm.rank == root else None, after)
  return grad, grad


def _scatter(comm, root, spec, label, phase, xs, after):
  del phase
  operand = xs if comm.rank == root else jnp.zeros((1,), spec.dtype)
  row = spec.shape[1:]
  return issue("scatter", comm, operand, after, shape=row, dtype=spec.dtype,
               count=math.prod(row), label=label, note=_note(row, spec.dtype), root=root)


def _scatter_backward(comm, root, spec, had_xs, ct, after):
  grad = _gather(comm, root, f"mnjax.functions.scatter's backward (gather to root {root})",
                 "gradient", ct, after)
  if comm.rank == root:
    return grad, grad
  return (jnp.zeros(spec.shape, spec.dtype) if had_xs else None), grad


def _allgather(comm, label, x, after):
  return issue("allgather", comm, x, after, shape=(comm.size, *x.shape), dtype=x.dtype,
               count=x.size, label=label, note=_note(x.shape, x.dtype))


def _allgather_backward(comm, ct, after):
  rows = _alltoall(comm, "mnjax.functions.allgather's backward (all-to-all)", ct, after)
  return rows.astype(sum_dtype(ct.dtype)).sum(0).astype(ct.dtype), rows


def _alltoall(comm, label, xs, after):
  return issue("alltoall", comm, xs, after, shape=xs.shape, dtype=xs.dtype,
               count=xs.size // comm.size, label=label, note=_note(xs.shape, xs.dtype))


def _alltoall_backward(comm, ct, after):
  grad = _alltoall(comm, "mnjax.functions.alltoall's backward", ct, after)
  return grad, grad
