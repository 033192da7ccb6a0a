"""Gradient buckets: planning, packing into flat buffers, and the in-step argument checks."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _primitives as mpi_ops

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Bucket", "bucket_bytes_from_mb", "check_bucket_bytes",
    "check_float_leaves", "default_bucket_bytes", "group_by_dtype", "layer_order", "leaf_dtype",
    "pack", "plan_buckets", "tree_buckets", "unpack", "wire_dtype_of",
]


DEFAULT_BUCKET_BYTES: dict[str, int] = {"cpu": 256 << 10, "gpu": 4 << 20}


def default_bucket_bytes(comm: Communicator) -> int:
  """The bucket cap ``bucket_bytes="auto"`` gives on `comm`'s platform: 256 KiB CPU, 4 MiB GPU.

  Example:
    >>> default_bucket_bytes(mnjax.create_communicator("flat"))   # on a CPU
    262144
  """
  platform = comm.devices[0].platform if comm.devices else "cpu"
  return DEFAULT_BUCKET_BYTES["cpu" if platform == "cpu" else "gpu"]


def wire_dtype_of(dtype: Any) -> np.dtype:
  """The dtype a leaf of `dtype` travels as over MPI (half precision goes as float32).

  Example:
    >>> wire_dtype_of(jnp.bfloat16)
    dtype('float32')
  """
  return mpi_ops.sum_dtype(dtype)


def check_float_leaves(tree: Any, caller: str, *, real: bool = False) -> None:
  """`TypeError` naming the first leaf of `tree` that is not a float array (``real``: real float).

  Example:
    >>> check_float_leaves({"step": jnp.zeros((), jnp.int32)}, "my_fn")
    Traceback (most recent call last):
    TypeError: my_fn: every gradient leaf must be a floating-point ... leaf ['step'] ...
    >>> check_float_leaves({"scale": 0.5}, "my_fn")   # a Python float: float32 under jit
  """
  kind = jnp.floating if real else jnp.inexact
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = leaf_dtype(leaf)
    if dtype is None or not jnp.issubdtype(dtype, kind):
      what = "real floating-point" if real else "floating-point (or complex)"
      came = (f"dtype {dtype}" if hasattr(leaf, "dtype") else
              f"dtype {dtype} (a Python {type(leaf).__name__}, {leaf!r})" if dtype is not None
              else f"no dtype (a {type(leaf).__name__}, {_short(leaf)})")
      raise TypeError(
          f"{caller}: every gradient leaf must be a {what} array, but leaf"
          f" {jax.tree_util.keystr(path) or '<root>'} has {came}."
          + (" A half-precision wire_dtype carries real float gradients only: use"
             " wire_dtype=None for this tree." if real and dtype is not None
             and jnp.issubdtype(dtype, jnp.inexact) else
             " Only arrays of floats can be averaged across ranks: keep integer, boolean,"
             " float0 and non-array leaves out of the differentiated parameters (e.g. in a"
             " separate flax collection), or differentiate float parameters only.")
      )


def leaf_dtype(leaf: Any) -> np.dtype | None:
  """The dtype `leaf` has inside a trace (a Python number's as ``jax.jit`` gives it), or None.

  Example:
    >>> leaf_dtype(1.0), leaf_dtype(np.zeros(2, np.int8)), leaf_dtype("x")
    (dtype('float32'), dtype('int8'), None)
  """
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None:
    return dtype
  if isinstance(leaf, (bool, int, float, complex)):
    return jnp.result_type(leaf)
  return None


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else f"{text[:57]}..."


def check_bucket_bytes(bucket_bytes: Any, caller: str,
                       comm: Communicator | None = None) -> int | None:
  """`bucket_bytes` checked: None, a positive int, or ``"auto"`` (resolved for `comm`).

  Example:
    >>> check_bucket_bytes(25 * 2**20, "allreduce_gradients")
    26214400
  """
  if bucket_bytes is None:
    return None
  if isinstance(bucket_bytes, str) and bucket_bytes == "auto" and comm is not None:
    return default_bucket_bytes(comm)
  if (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer))
      or bucket_bytes <= 0):
    raise ValueError(
        f"{caller}: bucket_bytes must be 'auto' (the platform's default), None (one buffer"
        f" per dtype, no cap) or a positive number of bytes, got {bucket_bytes!r}; e.g."
        " bucket_bytes=25 * 2**20 for PyTorch DDP's default 25 MB buckets."
    )
  return int(bucket_bytes)


def bucket_bytes_from_mb(value: str) -> int | str | None:
  """A ``--bucket_mb`` value as `bucket_bytes`: ``auto``, ``0`` (one buffer per dtype) or MiB.

  Example:
    >>> bucket_bytes_from_mb("auto"), bucket_bytes_from_mb("0"), bucket_bytes_from_mb("0.5")
    ('auto', None, 524288)
  """
  if value == "auto":
    return "auto"
  try:
    mb = float(value)
  except ValueError:
    mb = -1.0
  if mb < 0:
    raise ValueError(f"--bucket_mb must be 'auto', 0 (one buffer per dtype) or a positive"
                     f" number of MiB, got {value!r}.")
  return None if mb == 0 else max(1, int(mb * 2**20))


class Bucket(NamedTuple):
  """Leaves (by position in the flattened tree) packed into one buffer of `dtype`."""

  dtype: np.dtype
  positions: tuple[int, ...]


def group_by_dtype(dtypes: list[Any], key=wire_dtype_of) -> list[Bucket]:
  """Leaf positions grouped by ``key(dtype)``, in first-appearance order (same on every rank).

  Example:
    >>> group_by_dtype([jnp.float32, jnp.complex64, jnp.bfloat16])
    [Bucket(dtype=dtype('float32'), positions=(0, 2)),
     Bucket(dtype=dtype('complex64'), positions=(1,))]
  """
  by_key: dict[np.dtype, list[int]] = {}
  for i, dtype in enumerate(dtypes):
    by_key.setdefault(np.dtype(key(dtype)), []).append(i)
  return [Bucket(d, tuple(p)) for d, p in by_key.items()]


def plan_buckets(leaves: list[Any], *, wire_dtype: np.dtype | None = None,
                 bucket_bytes: int | None = None) -> list[Bucket]:
  """Buckets per dtype (float32 with a 16-bit wire), leaves reversed, each <= `bucket_bytes`.

  Example:
    >>> plan_buckets([jnp.ones(4), jnp.ones(4), jnp.ones(4)], bucket_bytes=32)
    [Bucket(dtype=dtype('float32'), positions=(2, 1)),
     Bucket(dtype=dtype('float32'), positions=(0,))]
  """
  key = (lambda dtype: np.float32) if wire_dtype is not None else wire_dtype_of
  groups = group_by_dtype([leaf.dtype for leaf in leaves], key=key)
  if bucket_bytes is None:
    return groups
  buckets = []
  for group in groups:
    itemsize = (wire_dtype or group.dtype).itemsize
    current, size = [], 0
    for i in reversed(group.positions):
      nbytes = leaves[i].size * itemsize
      if current and size + nbytes > bucket_bytes:
        buckets.append(Bucket(group.dtype, tuple(current)))
        current, size = [], 0
      current.append(i)
      size += nbytes
    buckets.append(Bucket(group.dtype, tuple(current)))
  return buckets


def pack(leaves: list[Any], dtype: Any, scale: float | None = None) -> jax.Array:
  """Leaves raveled, times `scale`, cast to `dtype`, end to end (docs/design/allreduce.md).

  Example:
    >>> pack([jnp.ones((2, 2)), jnp.zeros(3, jnp.bfloat16)], jnp.float32).shape
    (7,)
  """
  def flat(leaf):
    x = jnp.ravel(leaf)
    if scale is not None:
      x = x.astype(jnp.promote_types(x.dtype, jnp.float32)) * scale
    return x.astype(dtype)

  if len(leaves) == 1:
    return flat(leaves[0])
  if np.dtype(dtype).itemsize < 4:
    return jnp.concatenate([flat(leaf) for leaf in leaves])
  total = sum(leaf.size for leaf in leaves)
  buf = jnp.zeros((total,), dtype)
  offset = 0
  for leaf in leaves:
    buf = jax.lax.dynamic_update_slice(buf, flat(leaf), (offset,))
    offset += leaf.size
  return buf


def unpack(buf: jax.Array, like: list[Any], post=None) -> list[jax.Array]:
  """Inverse of `pack`: slices of `buf` shaped and typed as `like`, `post` applied before the cast.

  Example:
    >>> leaves = [jnp.ones((2, 2)), jnp.zeros(3)]
    >>> [x.shape for x in unpack(pack(leaves, jnp.float32), leaves)]
    [(2, 2), (3,)]
  """
  out, offset = [], 0
  for leaf in like:
    piece = buf[offset:offset + leaf.size].reshape(leaf.shape)
    out.append((piece if post is None else post(piece)).astype(leaf.dtype))
    offset += leaf.size
  return out


def tree_buckets(tree: Any, *, wire_dtype: Any = None, bucket_bytes: int | None = None
                 ) -> tuple[list[int], list[Bucket]]:
  """`allreduce_tree`'s plan: leaf positions in `layer_order`, and `plan_buckets` of that order.

  Example:
    >>> order, buckets = tree_buckets({"a": jnp.ones(4), "b": jnp.ones(4)}, bucket_bytes=16)
    >>> order, [b.positions for b in buckets]
    ([0, 1], [(1,), (0,)])
  """
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  order = layer_order(paths)
  leaves = jax.tree_util.tree_leaves(tree)
  return order, plan_buckets([leaves[i] for i in order], wire_dtype=wire_dtype,
                             bucket_bytes=bucket_bytes)


def layer_order(paths: list[str]) -> list[int]:
  """Leaf positions by path, numbers compared as numbers (``Dense_9`` before ``Dense_10``).

  Example:
    >>> layer_order(["['Dense_0']['kernel']", "['Dense_1']['kernel']",
    ...              "['Dense_10']['kernel']", "['Dense_2']['kernel']"])
    [0, 1, 3, 2]
  """
  def natural(i):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", paths[i])]

  return sorted(range(len(paths)), key=natural)
