"""`allreduce_tree`: a pytree reduced in fused buffers, per kind (docs/design/multi_device.md)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _exact as exact
from mnjax.comm._instep import _primitives as mpi_ops
from mnjax.comm._instep import _recorder as recorder
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep import _wire as wire
from mnjax.comm._instep._buckets import (
  Bucket,
  check_bucket_bytes,
  check_float_leaves,
  pack,
  tree_buckets,
  unpack,
)

__all__ = [
    "allreduce_tree", "buckets_leave_early", "completion_token", "leaves_early", "sum_buffer",
]


def allreduce_tree(tree: Any, comm: Communicator, *, mean: bool = True, wire_dtype: Any = None,
                   bucket_bytes: int | str | None = "auto", keep_inputs: bool = False) -> Any:
  """Sums (or averages) every leaf of `tree` over all replicas, inside a jitted step (inside
  `mnjax.data_parallel` for multi-device kinds). Raises TypeError (non-float leaf), ValueError.

  Args:
    tree: float (complex too without `wire_dtype`) leaves, the same structure on every rank.
    mean: divide the sum by the number of replicas (processes x local devices).
    wire_dtype: None, or ``jnp.bfloat16`` / ``jnp.float16``: 16-bit traffic, float32 sums.
    bucket_bytes: largest buffer in wire bytes (``"auto"``: `default_bucket_bytes`; None: no cap).
    keep_inputs: leaves reduced alone in their bucket go to new buffers instead of their own
      (for leaves the step reads again, or its inputs: saves XLA's copy of each).

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> jax.jit(lambda g: mnjax.comm.allreduce_tree(g, comm))({"w": jnp.ones(3)})
    {'w': Array([1., 1., 1.], dtype=float32)}
  """
  check_communicator(comm, "allreduce_tree")
  wire_dtype = wire.check_wire_dtype(wire_dtype, "allreduce_tree")
  bucket_bytes = check_bucket_bytes(bucket_bytes, "allreduce_tree", comm)
  check_float_leaves(tree, "allreduce_tree", real=wire_dtype is not None)
  if comm.num_replicas == 1:
    return tree
  flat, treedef = jax.tree_util.tree_flatten(tree)
  order, buckets = tree_buckets(tree, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes)
  leaves = [jnp.asarray(flat[i]) for i in order]  # Python floats too (a no-op on arrays)
  out: list[Any] = [None] * len(leaves)
  # Chain after the step's last collective; without one, leave when ready (see leaves_early).
  previous = sequence.ORDER.last()
  if previous is None and (sequence.noted("SyncBatchNorm") or not leaves_early(comm)):
    previous = completion_token(leaves)
  # 16-bit wire: pack straight to 16 bits unless a local psum or the node-aware path comes first.
  node_aware = comm.kind == "flat" and bool(comm.node_comms)
  half_pack = wire_dtype is not None and not node_aware and (
      comm.kind in ("flat", "xla") or (comm.kind == "single_node" and comm.size == 1))
  for k, bucket in enumerate(buckets):
    members = [leaves[i] for i in bucket.positions]
    size = sum(int(np.size(m)) for m in members)
    what = f"allreduce_tree bucket {k + 1} of {len(buckets)}"
    if comm.exact:  # the step's fingerprint (`mnjax.guard._preflight`): two int32 sums
      sequence.note_collective(what + " (exact: exponents)", (exact.BINS,), np.int32,
                               over=comm.mpi_comm)
      sequence.note_collective(what + " (exact: limbs)", (exact.LIMBS * size,), np.int32,
                               over=comm.mpi_comm)
    else:
      sequence.note_collective(what, (size,),
                               bucket.dtype if wire_dtype is None else wire_dtype,
                               over=comm.mpi_comm)
    sent = (exact.LIMBS * size + exact.BINS) * 4 if comm.exact else size * bucket.dtype.itemsize
    with recorder.tagging("bucket allreduce", bucket=k, bytes=sent):
      previous = _bucket(members, bucket, out, comm, wire_dtype, previous, mean, half_pack,
                         keep_inputs)
  if previous is not None:
    sequence.ORDER.put(previous)  # a later collective of the step comes after these
  in_tree_order = [None] * len(out)
  for position, leaf in zip(order, out):
    in_tree_order[position] = leaf
  return jax.tree_util.tree_unflatten(treedef, in_tree_order)


def _bucket(members, bucket: Bucket, out: list, comm: Communicator, wire_dtype, previous,
            mean: bool, half_pack: bool, keep_inputs: bool):
  """Reduces one bucket into `out` (at its leaves' positions); returns the chain's new link."""
  replicas = comm.num_replicas
  if comm.exact:  # integer limbs: the same bits whatever the processes (`_exact`)
    if bucket.dtype != jnp.float32:
      raise ValueError(
          f"allreduce_tree: an exact communicator (replicas=) sums float32 gradients (16-bit"
          f" ones travel as float32), got a {bucket.dtype} bucket. Use float32 parameters.")
    buf = _exact_sum(pack(members, jnp.float32), comm, previous)
    post = (lambda x: x / jnp.asarray(replicas, x.dtype)) if mean else None
    for i, leaf in zip(bucket.positions, unpack(buf, members, post=post)):
      out[i] = leaf
    return buf
  if _in_place(members, bucket, wire_dtype, comm):
    # In its own shape: raveling first makes XLA:CPU copy around the in-place call.
    (leaf,) = members
    total, link = _linked_sum(leaf, comm, None, previous, keep_input=keep_inputs)
    out[bucket.positions[0]] = total / jnp.asarray(replicas, leaf.dtype) if mean else total
    return link
  if wire_dtype is None:
    buf = pack(members, bucket.dtype)
    post = (lambda x: x / jnp.asarray(replicas, x.dtype)) if mean else None
  else:
    buf = pack(members, wire_dtype if half_pack else bucket.dtype, scale=1.0 / replicas)
    post = None if mean else (lambda x: x.astype(jnp.float32) * replicas)
  buf, link = _linked_sum(buf, comm, wire_dtype, previous)
  for i, leaf in zip(bucket.positions, unpack(buf, members, post=post)):
    out[i] = leaf
  return link


def _linked_sum(buf, comm: Communicator, wire_dtype, after, *, keep_input: bool = False):
  """``(sum, the chain's next link)``. On ``flat`` without a 16-bit wire the next bucket starts
  after this one's start, not its done: every bucket is in flight at once (one at a time, the
  next start waits for XLA to run the done's continuation, and double buffering's exchange
  hid nothing); elsewhere the link is the sum."""
  if comm.kind == "flat" and wire_dtype is None:
    return mpi_ops.allreduce_sum_linked(buf, comm.device_comm, after, keep_input=keep_input)
  total = _REDUCERS[comm.kind](buf, comm, wire_dtype, after)
  return total, total


def leaves_early(comm: Communicator) -> bool:
  """True: a bucket leaves as soon as its leaves are ready, while the backward pass goes on
  (on CPUs too: the exchange runs in two halves beside compute; docs/design/allreduce.md).

  Example:
    >>> leaves_early(comm)
    True
  """
  del comm  # the same on every platform; kept for the benchmarks' and tests' override
  return True if _EARLY.value is None else _EARLY.value


class _Early(threading.local):
  value: bool | None = None


_EARLY = _Early()


@contextlib.contextmanager
def buckets_leave_early(value: bool) -> Iterator[None]:
  """Steps traced inside the block decide `leaves_early` as `value` (benchmarks, tests).

  Example:
    >>> with buckets_leave_early(True):
    ...   leaves_early(comm)
    True
  """
  before, _EARLY.value = _EARLY.value, bool(value)
  try:
    yield
  finally:
    _EARLY.value = before


def _in_place(members: list[Any], bucket: Bucket, wire_dtype, comm: Communicator) -> bool:
  """Whether a bucket's single leaf goes to MPI as it is (no pack, no cast)."""
  return (len(members) == 1 and wire_dtype is None and comm.kind == "flat"
          and np.dtype(members[0].dtype) == bucket.dtype)


def completion_token(leaves: list[Any]) -> jax.Array:
  """A scalar that depends on every leaf: an `after` operand that waits for all of them."""
  return sum((jnp.ravel(leaf)[0].real.astype(jnp.float32) for leaf in leaves if leaf.size),
             jnp.zeros((), jnp.float32))


def sum_buffer(buf: jax.Array, comm: Communicator, after: Any = None) -> jax.Array:
  """Sum of a 1-D `buf` over every replica of `comm` in a step, after `after`; not differentiable.
  On an exact communicator (``replicas=``) an exact sum (`_exact`): the same bits on any layout.

  Example:
    >>> total = jax.jit(lambda v: mnjax.comm._instep._allreduce.sum_buffer(v, comm))(jnp.ones(3))
  """
  if comm.num_replicas == 1:
    return buf
  if comm.exact:  # integer limbs, as the gradient buckets: the same bits on any layout
    with recorder.tagging("SyncBatchNorm statistics",
                          bytes=(exact.LIMBS * buf.size + exact.BINS) * 4):
      total = _exact_sum(buf.astype(jnp.float32), comm, after)
    return total.astype(buf.dtype)
  with recorder.tagging("SyncBatchNorm statistics", bytes=buf.size * buf.dtype.itemsize):
    return _REDUCERS[comm.kind](buf, comm, None, after)


def _exact_sum(buf, comm: Communicator, after):
  """The exact sum of float32 `buf` over every replica (`_exact`): int32 limbs through the
  kind's own reduction, the same bits on any layout."""
  return exact.exact_sum(buf, comm.num_replicas,
                         lambda x, a: _REDUCERS[comm.kind](x, comm, None, a), after)


def _mpi_sum(buf, mpi_comm, wire_dtype, after):
  """Sum over `mpi_comm`, returned in `buf`'s dtype."""
  if wire_dtype is None:
    return mpi_ops.allreduce_sum(buf, mpi_comm, after)
  summed = wire.half_allreduce(buf, wire_dtype, mpi_comm.Get_size(),
                               lambda x: mpi_ops.alltoall(x, mpi_comm, after),
                               lambda x: mpi_ops.allgather(x, mpi_comm))  # after the alltoall
  return summed.astype(buf.dtype)


def _flat(buf, comm, wire_dtype, after):
  if wire_dtype is not None and comm.node_comms:
    return _node_aware_half(buf, comm, wire_dtype, after)
  return _mpi_sum(buf, comm.device_comm, wire_dtype, after)


def _node_aware_half(buf, comm, wire_dtype, after):
  """16-bit wire over nodes: float32 reduce-scatter in a node, 16-bit allreduce across, gather."""
  within, across = comm.node_comms
  k = within.Get_size()
  n = buf.size
  shard = -(-n // k)
  padded = jnp.pad(buf.astype(jnp.float32), (0, shard * k - n))
  rows = mpi_ops.alltoall(padded.reshape(k, shard), within, after)
  total = rows[0]
  for row in range(1, k):
    total = total + rows[row]
  summed = wire.half_allreduce(total, wire_dtype, across.Get_size(),
                               lambda x: mpi_ops.alltoall(x, across),
                               lambda x: mpi_ops.allgather(x, across))
  gathered = mpi_ops.allgather(summed, within).reshape(-1)
  return gathered[:n].astype(buf.dtype)


def _axis(buf, comm, wire_dtype, after):
  """XLA's own collectives over ``comm.axis_name`` (local devices, or all for xla)."""
  del after  # XLA orders its own collectives
  if wire_dtype is None:
    return jax.lax.psum(buf, comm.axis_name)
  axis = comm.axis_name
  summed = wire.half_allreduce(buf, wire_dtype, comm.num_replicas,
                               lambda x: jax.lax.all_to_all(x, axis, 0, 0),
                               lambda x: jax.lax.all_gather(x, axis))
  return summed.astype(buf.dtype)


def _hierarchical(buf, comm, wire_dtype, after):
  """psum over local devices; device 0 allreduces across processes; psum hands it out."""
  local = jax.lax.psum(buf, comm.axis_name)
  if comm.size == 1:
    return local
  first = jax.lax.axis_index(comm.axis_name) == 0
  reduced = jax.lax.cond(
      first, lambda b, a: _mpi_sum(b, comm.device_comms[0], wire_dtype, a),
      lambda b, a: jnp.zeros_like(b), local, mpi_ops.after_operand(after))
  return jax.lax.psum(reduced, comm.axis_name)


def _two_dimensional(buf, comm, wire_dtype, after):
  """Local reduce-scatter; local device i allreduces shard i across processes; all-gather."""
  n = comm.local_device_count
  padded = jnp.pad(buf, (0, (-buf.size) % n))
  shard = jax.lax.psum_scatter(padded, comm.axis_name, tiled=True)
  if comm.size > 1:
    branches = [lambda s, a, c=c: _mpi_sum(s, c, wire_dtype, a) for c in comm.device_comms]
    shard = jax.lax.switch(jax.lax.axis_index(comm.axis_name), branches, shard,
                           mpi_ops.after_operand(after))
  return jax.lax.all_gather(shard, comm.axis_name, tiled=True)[: buf.size]


def _single_node(buf, comm, wire_dtype, after):
  """One process: XLA's collectives; several on one node: as ``hierarchical``."""
  return (_axis if comm.size == 1 else _hierarchical)(buf, comm, wire_dtype, after)


_REDUCERS = {
    "flat": _flat,
    "single_node": _single_node,
    "xla": _axis,  # the axis spans every device of every process: XLA's own collectives
    "hierarchical": _hierarchical,
    "two_dimensional": _two_dimensional,
}
