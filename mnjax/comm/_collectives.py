"""In-step collectives on pytrees: fuse leaves into few flat buffers, reduce each once.

`allreduce_tree` runs *inside* a traced (jitted) step. It packs the gradient pytree into
contiguous buffers of at most `default_bucket_bytes` per dtype (``bucket_bytes``) and issues
one MPI allreduce per buffer, instead of one MPI call per leaf (161 calls for ResNet-50). Packing
and unpacking are ordinary XLA ops that fuse with the surrounding step; the packed buffer is
an intermediate, so the in-place MPI handler (`mnjax.comm._native`) reduces it where it lies. On a
size-1 communicator no collective is traced at all, so single-process runs pay nothing.

Which dtypes MPI can sum is `mnjax.comm._primitives`'s to say (`sum_dtype`): it has no
16-bit float type, so half-precision *leaves* travel as float32 and are cast back here,
while a half-precision *wire* (``wire_dtype``) is built from 16-bit moves with float32 sums
(`mnjax.comm._wire`). Host-level transfers (initial parameters, metrics) live in
`mnjax.comm._host`.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm import _primitives as mpi_ops
from mnjax.comm import _sequence as sequence
from mnjax.comm import _wire as wire
from mnjax.comm._communicator import Communicator, check_communicator

__all__ = [
    "DEFAULT_BUCKET_BYTES", "allreduce_tree", "bucket_bytes_from_mb", "check_bucket_bytes",
    "check_float_leaves", "completion_token", "default_bucket_bytes", "group_by_dtype",
    "leaf_dtype", "pack", "plan_buckets", "sum_buffer", "unpack", "wire_dtype_of",
]


# The default bucket cap per platform (``bucket_bytes="auto"``), see `default_bucket_bytes`.
DEFAULT_BUCKET_BYTES: dict[str, int] = {"cpu": 256 << 10, "gpu": 4 << 20}


def default_bucket_bytes(comm: Communicator) -> int:
  """The bucket cap ``bucket_bytes="auto"`` gives on `comm`'s platform.

  CPU, 256 KiB: fuse only small leaves, so that every larger leaf travels alone and is
  reduced in place in its own shape (`allreduce_tree`). ``python -m mnjax.bench allreduce``
  on ResNet-50's 161 leaves, 2 ranks (docs/design/allreduce.md): 16.8 ms, 2.48x raw MPI on
  one fused buffer and 0.79x raw MPI in place per leaf; 64 KiB and 1 MiB caps within 6%,
  the old 4 MiB 1.6x slower, one buffer 9x.
  GPU, 4 MiB, from the cost model until a GPU measures it:
  `mnjax.costmodel.step.best_bucket_bytes` for ResNet-50 on 8 and 1024 H200s (NDR),
  ``flat`` and ``xla``, with an assumed 30 us per call (a stream synchronisation and host
  staging in mpi4jax's CUDA handler), picks 4 MiB (tests/unit/test_costmodel.py checks that they
  agree); the margins are small (under 0.5% of a 12 ms step between 1 and 16 MiB).

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
  """Raises a `TypeError` naming the first leaf of `tree` that is not a float array.

  Gradients of integer or boolean leaves are not averaged (JAX gives them ``float0``);
  they must not enter the allreduce. With ``real=True`` (a half-precision wire) complex
  leaves are refused too. A Python number is judged by the dtype ``jax.jit`` gives it (a
  float is float32, an int int32), so a tree is accepted or refused alike eagerly (e.g.
  ``tx.init(params)``) and inside a trace.

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
  """The dtype `leaf` has inside a trace: its own, or for a Python number the one
  ``jax.jit`` gives it (float32 for a float, int32 for an int); None for anything else.

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
  """`bucket_bytes` if it is None (no cap) or a positive int, ``"auto"`` resolved for
  `comm`'s platform (`default_bucket_bytes`), else a ValueError.

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
  """A command-line ``--bucket_mb`` as `bucket_bytes`: ``auto``, ``0`` (one buffer per dtype)
  or a positive number of MiB.

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
  """How the leaves are fused: one bucket per dtype, or buckets of at most `bucket_bytes`.

  With a half-precision `wire_dtype` every (real) leaf accumulates in float32. With
  `bucket_bytes`, each dtype's leaves are taken in *reverse* tree order (for a sequential
  model roughly the order backprop produces them, as in PyTorch DDP) and cut into buckets
  whose wire size stays within the cap; a leaf larger than the cap gets a bucket of its own.

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
  """Leaves raveled and cast to `dtype`, laid end to end in one 1-D buffer (traceable).

  With `scale`, each leaf is multiplied by it in float32 (or wider) before the cast, in the
  same pass.

  32- and 64-bit buffers are written as a chain of `dynamic_update_slice` into a zero
  buffer: XLA:CPU emits a many-operand `jnp.concatenate` as one fused loop that selects the
  source operand per element (the digits CNN's 151k gradients: 580 us vs 200 us). 16-bit
  buffers are concatenated: XLA:CPU does not update them in place (ResNet-50's 161 leaves
  into bfloat16: 2.5 s with `dynamic_update_slice`, 64 ms concatenated).

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
  """Inverse of `pack`: slices of `buf` with the shapes and dtypes of the leaves in `like`.

  `post`, if given, is applied to each slice before the cast (it fuses with the slice).

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


def allreduce_tree(tree: Any, comm: Communicator, *, mean: bool = True, wire_dtype: Any = None,
                   bucket_bytes: int | str | None = "auto") -> Any:
  """Sums (or averages) every leaf of `tree` over all replicas; call inside a jitted step.

  Leaves are packed into buffers (`plan_buckets`), each reduced once and unpacked to the
  leaves' shapes and dtypes. MPI traffic uses `mnjax.comm._primitives` (no JAX effect, so the step
  keeps JAX's fast asynchronous dispatch) on the in-step communicators; buffers are chained
  through data dependencies so every rank issues them in one order. For the multi-device
  kinds call it inside `mnjax.data_parallel` (the local axis must be bound).

  Args:
    tree: pytree of float arrays (complex too without `wire_dtype`), the same structure on
      every rank.
    comm: the `Communicator`.
    mean: divide the sum by the number of replicas (processes x local devices).
    wire_dtype: None (leaves travel in their own precision) or ``jnp.bfloat16`` /
      ``jnp.float16``: cross-process traffic in 16 bits with float32 sums, error bound in
      `mnjax.comm._wire`.
    bucket_bytes: the largest buffer, in wire bytes (a larger leaf travels alone,
      unpacked); ``"auto"``: the platform's default (`default_bucket_bytes`); None: one
      buffer per dtype.

  Returns:
    A pytree like `tree` holding the global sum or mean.

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
  replicas = comm.num_replicas
  # The first exchange comes after the last mnjax collective traced before it in this step
  # (`mnjax.comm._sequence.ORDER`: SyncBatchNorm's backward ones), so every rank issues them
  # in one order; without any, it waits for its own leaves only, and the buckets of the last
  # layers leave while the first layers' gradients are still computed. A chain link from
  # another trace (SyncBatchNorm under remat) is not visible: then wait for every leaf.
  previous = sequence.ORDER.last()
  if previous is None and sequence.noted("SyncBatchNorm"):
    previous = completion_token(leaves)
  # With a 16-bit wire, values are divided by the replica count *before* they travel (so
  # what travels sums to the mean: fp16's range), and where the whole reduction is the
  # 16-bit exchange (no float32 local psum first) leaves are packed straight into the wire
  # dtype: one pass over the gradients instead of two.
  half_pack = wire_dtype is not None and comm.kind in ("flat", "single_node", "xla")
  for k, bucket in enumerate(buckets):
    members = [leaves[i] for i in bucket.positions]
    sequence.note_collective(  # the step's fingerprint (`mnjax.guard._preflight`)
        f"allreduce_tree bucket {k + 1} of {len(buckets)}",
        (sum(int(np.size(m)) for m in members),),
        bucket.dtype if wire_dtype is None else wire_dtype)
    if _in_place(members, bucket, wire_dtype, comm):
      # A leaf alone in its bucket is reduced where it lies, in its own shape: raveling it
      # first makes XLA:CPU copy it into a fresh buffer and back around the in-place call
      # (ResNet-50 per leaf: 0.5x raw MPI raveled; see `default_bucket_bytes`).
      (leaf,) = members
      previous = _REDUCERS[comm.kind](leaf, comm, None, previous)
      out[bucket.positions[0]] = previous / jnp.asarray(replicas, leaf.dtype) if mean else previous
      continue
    if wire_dtype is None:
      buf = pack(members, bucket.dtype)
      post = (lambda x: x / jnp.asarray(replicas, x.dtype)) if mean else None
    else:
      buf = pack(members, wire_dtype if half_pack else bucket.dtype, scale=1.0 / replicas)
      post = None if mean else (lambda x: x.astype(jnp.float32) * replicas)
    # `after`: each collective waits for the previous one, so every rank issues them in one
    # order (XLA:CPU would otherwise run independent custom calls in any order).
    buf = _REDUCERS[comm.kind](buf, comm, wire_dtype, previous)
    previous = buf
    for i, leaf in zip(bucket.positions, unpack(buf, members, post=post)):
      out[i] = leaf
  if previous is not None:
    sequence.ORDER.put(previous)  # a later collective of the step comes after these
  in_tree_order = [None] * len(out)
  for position, leaf in zip(order, out):
    in_tree_order[position] = leaf
  return jax.tree_util.tree_unflatten(treedef, in_tree_order)


def tree_buckets(tree: Any, *, wire_dtype: Any = None, bucket_bytes: int | None = None
                 ) -> tuple[list[int], list[Bucket]]:
  """`allreduce_tree`'s plan for `tree`: the leaves in `layer_order` (positions in
  ``jax.tree.leaves(tree)``) and the buckets (`plan_buckets`: the last layers' first),
  whose positions index that order.

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
  """Leaf positions in the layers' order, as flax auto-names them in call order: paths
  sorted with their numbers compared as numbers (``Dense_9`` before ``Dense_10``, where
  the tree's own order puts ``Dense_10`` first). `plan_buckets` takes it backwards: the
  output layer's gradients, which backprop finishes first, leave first.

  The same on every rank (a function of the tree, which the pre-flight check compares).

  Example:
    >>> layer_order(["['Dense_0']['kernel']", "['Dense_1']['kernel']",
    ...              "['Dense_10']['kernel']", "['Dense_2']['kernel']"])
    [0, 1, 3, 2]
  """
  def natural(i):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", paths[i])]

  return sorted(range(len(paths)), key=natural)


def _in_place(members: list[Any], bucket: Bucket, wire_dtype, comm: Communicator) -> bool:
  """Whether a bucket's single leaf can go to MPI as it is (no pack, no cast: ``flat``)."""
  return (len(members) == 1 and wire_dtype is None and comm.kind == "flat"
          and np.dtype(members[0].dtype) == bucket.dtype)


def completion_token(leaves: list[Any]) -> jax.Array:
  """A scalar that depends on every leaf: an `after` operand that waits for all of them."""
  return sum((jnp.ravel(leaf)[0].real.astype(jnp.float32) for leaf in leaves if leaf.size),
             jnp.zeros((), jnp.float32))


def sum_buffer(buf: jax.Array, comm: Communicator, after: Any = None) -> jax.Array:
  """Sum of a 1-D buffer over every replica of `comm`, in `buf`'s dtype; call inside a step.

  The building block under `allreduce_tree` (no packing, no mean), for layers that reduce
  their own statistics (`mnjax.SyncBatchNorm`). `after`: an array this collective must wait
  for, the previous collective's result, so that every rank issues collectives in one order.
  Not differentiable by itself (wrap it in a `jax.custom_vjp`, as SyncBatchNorm does).

  Example:
    >>> total = jax.jit(lambda v: mnjax.comm._collectives.sum_buffer(v, comm))(jnp.ones(3))
  """
  if comm.num_replicas == 1:
    return buf
  return _REDUCERS[comm.kind](buf, comm, None, after)


# Sum of a fused 1-D buffer over every replica, per communicator kind. The multi-device
# kinds run inside `mnjax.data_parallel`'s shard_map, where ``comm.axis_name`` names the
# local devices. MPI programs are picked per device with lax.cond/lax.switch on the axis
# index: the communicator is a compile-time attribute of the custom call, the same on every
# device of the SPMD program. Measured choice: docs/design/multi_device.md.


def _mpi_sum(buf, mpi_comm, wire_dtype, after):
  """Sum over `mpi_comm`, returned in `buf`'s dtype."""
  if wire_dtype is None:
    return mpi_ops.allreduce_sum(buf, mpi_comm, after)
  summed = wire.half_allreduce(buf, wire_dtype, mpi_comm.Get_size(),
                               lambda x: mpi_ops.alltoall(x, mpi_comm, after),
                               lambda x: mpi_ops.allgather(x, mpi_comm))  # after the alltoall
  return summed.astype(buf.dtype)


def _flat(buf, comm, wire_dtype, after):
  return _mpi_sum(buf, comm.device_comm, wire_dtype, after)


def _axis(buf, comm, wire_dtype, after):
  del after  # XLA orders its own collectives
  """XLA's own collectives over ``comm.axis_name`` (local devices, or all for xla)."""
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
  """Reduce-scatter over local devices; local device i allreduces shard i across processes
  on its own communicator; all-gather over local devices."""
  n = comm.local_device_count
  padded = jnp.pad(buf, (0, (-buf.size) % n))
  shard = jax.lax.psum_scatter(padded, comm.axis_name, tiled=True)
  if comm.size > 1:
    branches = [lambda s, a, c=c: _mpi_sum(s, c, wire_dtype, a) for c in comm.device_comms]
    shard = jax.lax.switch(jax.lax.axis_index(comm.axis_name), branches, shard,
                           mpi_ops.after_operand(after))
  return jax.lax.all_gather(shard, comm.axis_name, tiled=True)[: buf.size]


_REDUCERS = {
    "flat": _flat,
    "single_node": _axis,
    "xla": _axis,  # the axis spans every device of every process: XLA's own collectives
    "hierarchical": _hierarchical,
    "two_dimensional": _two_dimensional,
}
