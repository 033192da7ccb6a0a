"""MPI collectives as effect-free JAX primitives, ordered by ``after`` (docs/design/gpu.md)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import ffi
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad, mlir
from mpi4py import MPI

from mnjax.comm import _cuda_mpi as cuda_mpi
from mnjax.comm._instep import _native as native
from mnjax.comm._instep import _recorder as recorder
from mnjax.comm._instep._compat import abstract_token, to_dtype_handle, to_mpi_handle

__all__ = [
    "NO_MPI_DATATYPE", "after_operand", "allgather", "allreduce_sum", "allreduce_sum_linked",
    "alltoall", "mpi_datatype", "sum_dtype",
]

#: The 16-bit floats, which MPI has no datatype for: moved as raw words, summed as float32.
NO_MPI_DATATYPE: tuple[np.dtype, ...] = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _handle(comm: MPI.Comm) -> int:
  return int(to_mpi_handle(comm))


def after_operand(after):
  """`after` as an array operand; a uint8 zero for the first collective of a computation."""
  return jnp.zeros((), jnp.uint8) if after is None else after


def mpi_datatype(dtype) -> np.int64:
  """The MPI datatype handle a buffer of `dtype` moves as (16-bit floats as uint16 words).

  Example:
    >>> bool(mpi_datatype(jnp.bfloat16) == mpi_datatype(jnp.uint16))
    True
  """
  if np.dtype(dtype) in NO_MPI_DATATYPE:
    return np.int64(to_mpi_handle(MPI.UINT16_T))
  return np.int64(to_dtype_handle(dtype))


def sum_dtype(dtype) -> np.dtype:
  """The dtype MPI sums a buffer of `dtype` in: float32 for the 16-bit floats, else itself.

  Example:
    >>> sum_dtype(jnp.bfloat16), sum_dtype(jnp.float64)
    (dtype('float32'), dtype('float64'))
  """
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype in NO_MPI_DATATYPE else dtype


def allreduce_sum(x, comm: MPI.Intracomm, after=None):
  """Sum of `x` over the ranks of `comm` in `jax.jit`, after `after`; not differentiable.

  Example:
    >>> total = jax.jit(lambda v: allreduce_sum(v, comm.device_comm))(jnp.ones(3))
    >>> total.tolist() == [comm.size] * 3
    True
  """
  return _allreduce_p.bind(x, after_operand(after), comm_handle=_handle(comm),
                           tag=recorder.tag_for_bind())


def allreduce_sum_linked(x, comm: MPI.Intracomm, after=None, *, keep_input: bool = False):
  """``(sum, link)``: `allreduce_sum`, and a uint8 zero that, as a later collective's `after`,
  orders its start after this one's start only: several exchanges in flight at once (on GPUs,
  where the call blocks, after the sum). `keep_input`: on CPUs MPI writes the sum to a new
  buffer and `x` stays as it was (no copy where `x` is a step's input, which XLA does not let
  a call overwrite); otherwise the sum replaces `x` in its own buffer.

  Example:
    >>> def two(a, b):
    ...   sa, link = allreduce_sum_linked(a, comm.device_comm)
    ...   return sa, allreduce_sum(b, comm.device_comm, after=link)   # posted beside `a`'s
    >>> sa, sb = jax.jit(two)(jnp.ones(3), jnp.ones(2))
    >>> sb.tolist() == [comm.size] * 2
    True
  """
  return _allreduce_linked_p.bind(x, after_operand(after), comm_handle=_handle(comm),
                                  tag=recorder.tag_for_bind(), keep_input=bool(keep_input))


def alltoall(x, comm: MPI.Intracomm, after=None):
  """Row ``j`` of `x` goes to rank ``j``; row ``j`` of the result came from rank ``j``.

  Example:
    >>> x = 10.0 * jnp.arange(comm.size)[:, None] + comm.rank   # row j goes to rank j
    >>> got = jax.jit(lambda v: alltoall(v, comm.device_comm))(x)
    >>> got[:, 0].tolist() == [10.0 * comm.rank + j for j in range(comm.size)]
    True
  """
  if x.ndim == 0 or x.shape[0] != comm.Get_size():
    raise ValueError(
        f"alltoall: the leading axis must have one row per rank ({comm.Get_size()}), got"
        f" shape {x.shape}."
    )
  return _alltoall_p.bind(x, after_operand(after), comm_handle=_handle(comm),
                          tag=recorder.tag_for_bind())


def allgather(x, comm: MPI.Intracomm, after=None):
  """Every rank's `x` stacked on a new leading axis of size ``comm.size``.

  Example:
    >>> jax.jit(lambda v: allgather(v, comm.device_comm))(jnp.full(3, comm.rank)).shape
    (1, 3)
  """
  return _allgather_p.bind(x, after_operand(after), comm_handle=_handle(comm), size=comm.Get_size(),
                           tag=recorder.tag_for_bind())


def _count(aval) -> np.int64:
  return np.int64(np.prod(aval.shape, dtype=np.int64))


def _cpu(target, attrs):
  """Lowering to an mnjax handler (x, after); a nonzero timeline `tag` selects ``_tagged``."""
  def rule(ctx, x, after, *, tag=0, **params):
    native.register()
    extra = {"tag": np.int64(tag)} if tag else {}
    lowering = ffi.ffi_lowering(target + ("_tagged" if tag else ""), has_side_effect=True)
    return lowering(ctx, x, after, **attrs(ctx, **params), **extra)
  return rule


def _cpu_in_halves(start, done, attrs):
  """Lowering to a start (posts the exchange in place, returns at once) and its done (waits for
  it): XLA:CPU runs the operations between them, or independent of them, while bytes move.
  With ``link``, the start's ``_linked`` form, whose one-byte second result is returned too;
  with ``keep_input``, the start writes a new buffer and the done keeps `x` live until the end."""
  def rule(ctx, x, after, *, tag=0, link=False, keep_input=False, **params):
    native.register()
    extra = {"tag": np.int64(tag)} if tag else {}
    target = start + ("_linked" if link else "") + ("_tagged" if tag else "")
    start_ctx = ctx.replace(avals_out=(ctx.avals_in[0], *ctx.avals_out[1:]))
    started = ffi.ffi_lowering(target, has_side_effect=True,
                               operand_output_aliases=None if keep_input else {0: 0})(
        start_ctx, x, after, **attrs(ctx, **params), **extra)
    kept = (x,) if keep_input else ()
    done_ctx = ctx.replace(avals_in=(ctx.avals_in[0],) * (1 + len(kept)),
                           avals_out=ctx.avals_out[:1])
    finished = ffi.ffi_lowering(done + ("_keeping" if kept else ""), has_side_effect=True,
                                operand_output_aliases={0: 0})(done_ctx, started[0], *kept)
    return [*finished, *started[1:]]
  return rule


def _linked(rule):
  """A GPU `rule` with a second result: a byte computed from the call's output."""
  def linked(ctx, x, after, *, keep_input=False, **params):
    del keep_input  # the GPU call is out of place and blocks
    (result,) = rule(ctx.replace(avals_out=ctx.avals_out[:1]), x, after, **params)
    link_ctx = ctx.replace(avals_in=ctx.avals_out[:1], avals_out=ctx.avals_out[1:])
    return [result, *mlir.lower_fun(_link_from, multiple_results=False)(link_ctx, result)]
  return linked


def _link_from(result):
  """A uint8 zero computed from `result` (XLA keeps ``s * 0`` for floats)."""
  s = jnp.ravel(result)[0].astype(jnp.float32)
  return (jnp.where(jnp.isfinite(s), s, 0.0) * 0.0).astype(jnp.uint8)


def _tie(x, after):
  """`x` bit for bit, but computed from `after`: ``x[0] * (1 + 0 * s)``, ``s`` from `after`
  (XLA keeps ``s * 0`` for floats; an ``optimization_barrier`` would be dropped)."""
  if x.size == 0 or after.size == 0 or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  s = jnp.ravel(after)[0].astype(jnp.float32)
  one = 1.0 + jnp.where(jnp.isfinite(s), s, 0.0) * 0.0  # exactly 1, computed from `after`
  flat = jnp.ravel(x)
  return flat.at[0].multiply(one.astype(x.dtype)).reshape(x.shape)  # x[0] * 1: bit for bit


def _gpu(target, attrs):
  """Lowering to mpi4jax's token-taking handler; `after` tied in by `_tie` (floats only)."""
  def rule(ctx, x, after, *, tag=0, **params):
    del tag  # mpi4jax's handlers take no tag: the timeline's named scope labels them
    if _gpu_backend():
      cuda_mpi.configure()  # mpi4jax's CUDA extension and an explicit copy mode, or why not
    tie_ctx = ctx.replace(avals_out=(ctx.avals_in[0],))
    x, = mlir.lower_fun(_tie, multiple_results=False)(tie_ctx, x, after)
    token = stablehlo.after_all([])
    sub = ctx.replace(avals_in=(ctx.avals_in[0], abstract_token),
                      avals_out=(*ctx.avals_out, abstract_token))
    result, _ = ffi.ffi_lowering(target, has_side_effect=True)(
        sub, x, token, **attrs(ctx, **params))
    return [result]
  return rule


def _gpu_backend() -> bool:
  """Whether this process runs on GPUs (lowering for ``cuda`` on a CPU machine only inspects)."""
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def _allreduce_attrs(ctx, *, comm_handle):
  aval = ctx.avals_in[0]
  return dict(count=_count(aval), op=np.int64(to_mpi_handle(MPI.SUM)),
              comm=np.int64(comm_handle), dtype=mpi_datatype(aval.dtype))


def _mpi4jax_allreduce_attrs(ctx, *, comm_handle):
  a = _allreduce_attrs(ctx, comm_handle=comm_handle)
  return dict(nitems=a["count"], op=a["op"], comm=a["comm"], dtype=a["dtype"])


def _alltoall_attrs(ctx, *, comm_handle):
  aval = ctx.avals_in[0]
  return dict(count=np.int64(_count(aval) // aval.shape[0]), comm=np.int64(comm_handle),
              dtype=mpi_datatype(aval.dtype))


def _allgather_attrs(ctx, *, comm_handle, size):
  del size
  aval = ctx.avals_in[0]
  return dict(count=_count(aval), comm=np.int64(comm_handle), dtype=mpi_datatype(aval.dtype))


def _mpi4jax_pairwise_attrs(attrs):
  def convert(ctx, **params):
    a = attrs(ctx, **params)
    return dict(sendcount=a["count"], sendtype=a["dtype"], recvcount=a["count"],
                recvtype=a["dtype"], comm=a["comm"])
  return convert


def _no_differentiation(*args, **kwargs):
  raise NotImplementedError(
      "mnjax's MPI collectives are not differentiable: reduce gradients after jax.grad (as"
      " allreduce_gradients does), not inside the differentiated function."
  )


def _define(name, shape_fn, cpu_rule, gpu_rule):
  p = Primitive(name)
  p.def_abstract_eval(lambda x, after, **params: ShapedArray(shape_fn(x, **params), x.dtype))
  mlir.register_lowering(p, cpu_rule, platform="cpu")
  mlir.register_lowering(p, gpu_rule, platform="cuda")
  ad.primitive_jvps[p] = _no_differentiation
  return p


_same = lambda x, **_: x.shape  # noqa: E731
_allreduce_p = _define(
    "mnjax_allreduce_sum", _same,
    _cpu_in_halves("mnjax_mpi_allreduce_start", "mnjax_mpi_allreduce_done", _allreduce_attrs),
    _gpu("mpi_allreduce_ffi", _mpi4jax_allreduce_attrs))
_allreduce_linked_p = Primitive("mnjax_allreduce_sum_linked")
_allreduce_linked_p.multiple_results = True
_allreduce_linked_p.def_abstract_eval(
    lambda x, after, **params: [ShapedArray(x.shape, x.dtype), ShapedArray((), jnp.uint8)])
mlir.register_lowering(_allreduce_linked_p, functools.partial(_cpu_in_halves(
    "mnjax_mpi_allreduce_start", "mnjax_mpi_allreduce_done", _allreduce_attrs), link=True),
    platform="cpu")
mlir.register_lowering(_allreduce_linked_p, _linked(
    _gpu("mpi_allreduce_ffi", _mpi4jax_allreduce_attrs)), platform="cuda")
ad.primitive_jvps[_allreduce_linked_p] = _no_differentiation
_alltoall_p = _define(
    "mnjax_alltoall", _same,
    _cpu("mnjax_mpi_alltoall", _alltoall_attrs),
    _gpu("mpi_alltoall_ffi", _mpi4jax_pairwise_attrs(_alltoall_attrs)))
_allgather_p = _define(
    "mnjax_allgather", lambda x, *, size, **_: (size, *x.shape),
    _cpu("mnjax_mpi_allgather", _allgather_attrs),
    _gpu("mpi_allgather_ffi", _mpi4jax_pairwise_attrs(_allgather_attrs)))
