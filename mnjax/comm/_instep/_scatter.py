"""In-step reduce-scatter and all-gather of pytrees for `mnjax.shard_optimizer` (ZeRO-1).

The reduce-scatter runs over ``flat`` communicators; the all-gather joins one share per
process, also under the multi-device kinds (every local device gets the same bits)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _primitives as mpi_ops
from mnjax.comm._instep._allreduce import completion_token
from mnjax.comm._instep._buckets import Bucket, group_by_dtype, plan_buckets

__all__ = ["allgather_tree", "reduce_scatter_tree", "shard_leaf", "share_size", "unshard_leaf"]


def share_size(n: int, parts: int) -> int:
  """Elements of each share of a leaf of `n` elements split into `parts`: ceil(n/parts).

  Example:
    >>> share_size(10, 3), share_size(1, 4), share_size(0, 2)
    (4, 1, 0)
  """
  return -(-int(n) // int(parts))


def _rows(leaf: Any, parts: int) -> jax.Array:
  """`leaf` raveled, zero-padded to ``parts * c`` and viewed as ``(parts, c)``."""
  flat = jnp.ravel(leaf)
  c = share_size(flat.size, parts)
  return jnp.pad(flat, (0, parts * c - flat.size)).reshape(parts, c)


def shard_leaf(leaf: Any, index: int, parts: int) -> jax.Array:
  """Share `index` of `parts` of `leaf`: 1-D, ``ceil(n / parts)`` elements, zero-padded.

  Example:
    >>> shard_leaf(jnp.arange(5.0), 1, 2).tolist()
    [3.0, 4.0, 0.0]
  """
  return _rows(leaf, parts)[index]


def unshard_leaf(shares: Any, shape: tuple[int, ...]) -> Any:
  """Inverse of `shard_leaf`: ``(parts, c)`` shares (numpy or jax) back to a leaf of `shape`.

  Example:
    >>> unshard_leaf(np.array([[0.0, 1, 2], [3, 4, 0]]), (5,)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
  """
  n = int(np.prod(shape, dtype=np.int64))
  return shares.reshape(-1)[:n].reshape(shape)


def reduce_scatter_tree(tree: Any, comm: Communicator, *, mean: bool = True,
                        wire_dtype: np.dtype | None = None, bucket_bytes: int | None = None,
                        after: Any = None) -> tuple[Any, jax.Array | None]:
  """``(shares, last)``: this rank's share of each leaf's global sum or mean, and the next `after`.

  Example:
    >>> from mnjax.comm._instep import _scatter
    >>> f = lambda g: _scatter.reduce_scatter_tree(g, comm)[0]
    >>> jax.jit(f)({"w": jnp.ones(3)})["w"].shape == (-(-3 // comm.size),)
    True
  """
  parts, replicas = comm.size, comm.num_replicas
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  if parts == 1:  # nothing to exchange: the share is the whole (raveled) leaf
    return jax.tree_util.tree_unflatten(treedef, [jnp.ravel(x) for x in leaves]), after
  out: list[Any] = [None] * len(leaves)
  previous = completion_token(leaves) if after is None else after
  for bucket in plan_buckets(leaves, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes):
    members = [leaves[i] for i in bucket.positions]
    if wire_dtype is None:
      buf = _side_by_side([_rows(x.astype(bucket.dtype), parts) for x in members])
    else:  # scaled in float32, rounded to 16 bits (what travels sums to the mean)
      buf = _side_by_side([_rows((x.astype(jnp.float32) / replicas).astype(wire_dtype), parts)
                           for x in members])
    received = mpi_ops.alltoall(buf, comm.device_comm, previous)
    total = received[0].astype(bucket.dtype)
    for row in range(1, parts):  # rank order: the same bits wherever it is computed
      total = total + received[row].astype(bucket.dtype)
    previous = total
    if wire_dtype is None and mean:
      total = total / jnp.asarray(replicas, total.dtype)
    elif wire_dtype is not None and not mean:
      total = total * replicas
    offset = 0
    for i, x in zip(bucket.positions, members):
      c = share_size(x.size, parts)
      share = total[offset:offset + c]
      out[i] = share if wire_dtype is not None else share.astype(x.dtype)
      offset += c
  return jax.tree_util.tree_unflatten(treedef, out), previous


def allgather_tree(shares: Any, shapes: Any, comm: Communicator, *,
                   bucket_bytes: int | None = None, after: Any = None) -> tuple[Any, Any]:
  """``(tree, last)``: every rank's `shares` joined into whole leaves of `shapes`, in a step.

  Example:
    >>> from mnjax.comm._instep import _scatter
    >>> f = lambda g: _scatter.allgather_tree(_scatter.reduce_scatter_tree(g, comm)[0], g,
    ...                                       comm)[0]
    >>> jax.jit(f)({"w": jnp.ones((2, 3))})["w"].shape
    (2, 3)
  """
  parts = comm.size
  leaves, treedef = jax.tree_util.tree_flatten(shares)
  like = treedef.flatten_up_to(shapes)
  if parts == 1:
    return jax.tree_util.tree_unflatten(
        treedef, [unshard_leaf(x, tuple(np.shape(t))) for x, t in zip(leaves, like)]), after
  out: list[Any] = [None] * len(leaves)
  previous = completion_token(leaves) if after is None else after
  for bucket in _exact_buckets(leaves, bucket_bytes):
    members = [leaves[i] for i in bucket.positions]
    row = members[0] if len(members) == 1 else jnp.concatenate(members)
    gathered = _gather_processes(row, comm, previous)  # (parts, sum c_i)
    previous = gathered
    offset = 0
    for i, x in zip(bucket.positions, members):
      out[i] = unshard_leaf(gathered[:, offset:offset + x.size], tuple(np.shape(like[i])))
      offset += x.size
  return jax.tree_util.tree_unflatten(treedef, out), previous


def _gather_processes(row: jax.Array, comm: Communicator, after: Any) -> jax.Array:
  """Every process's `row` stacked, ``(comm.size, n)``. Multi-device kinds: local device 0
  gathers across the processes and a ``psum`` of raw words with the others' zeros hands the
  rows to every local device, bit for bit."""
  if not comm.multi_device:
    return mpi_ops.allgather(row, comm.device_comm, after)
  first = jax.lax.axis_index(comm.axis_name) == 0
  rows = jax.lax.cond(
      first, lambda r, a: mpi_ops.allgather(r, comm.device_comms[0], a),
      lambda r, a: jnp.zeros((comm.size, *r.shape), r.dtype), row, mpi_ops.after_operand(after))
  words = jnp.dtype(f"uint{8 * rows.dtype.itemsize}")
  summed = jax.lax.psum(jax.lax.bitcast_convert_type(rows, words), comm.axis_name)
  return jax.lax.bitcast_convert_type(summed, rows.dtype)


def _exact_buckets(leaves: list[Any], bucket_bytes: int | None) -> list[Bucket]:
  """`plan_buckets` within each exact dtype (raw words: 16-bit stays 16-bit)."""
  buckets = []
  for group in group_by_dtype([x.dtype for x in leaves], key=np.dtype):
    members = [leaves[i] for i in group.positions]
    for b in plan_buckets(members, bucket_bytes=bucket_bytes):
      buckets.append(Bucket(group.dtype, tuple(group.positions[j] for j in b.positions)))
  return buckets


def _side_by_side(blocks: list[jax.Array]) -> jax.Array:
  return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)
