"""MPI collectives as JAX primitives without effects: allreduce, alltoall, allgather.

Why this exists: every mpi4jax primitive carries an *ordered effect*. A jitted function with
an ordered effect leaves JAX's C++ fast dispatch path and runs synchronously (each call
waits for the previous one's token). Measured here on the digits CNN train step (1 CPU
thread, 32 images): 6.1 ms plain, 9.0 ms with one mpi4jax allreduce on ``COMM_SELF`` — the
MPI call itself takes ~0.2 ms; the rest is dispatch. A data-parallel step therefore lost
~35% of its throughput before any byte moved.

The primitives here have no effect. They lower to side-effecting custom calls (so XLA never
removes or merges them): on CPU to mnjax's own handlers (`mnjax.comm._native`: allreduce in place,
no fresh result buffer and no copy), on GPU to the handlers mpi4jax registers, with a
fresh token. Jitted steps keep the fast path and asynchronous dispatch. What the ordered
effect used to guarantee is guaranteed instead by construction:

* within one computation, each collective takes an ``after`` operand: the previous
  collective's result (`mnjax.comm._collectives` threads it). On CPU this is a data dependency
  the handler ignores but XLA must respect (its runtime otherwise runs independent
  collectives concurrently, in any order); on GPU the operand's first element is
  recomputed from it (`_tie`), so XLA:GPU's scheduler (which may differ per rank:
  autotuning runs per process) cannot reorder them either;
* across computations, one device executes its programs in dispatch order, and every rank
  dispatches the same steps in the same order (SPMD);
* host-level mpi4py traffic (`broadcast`, `allreduce_metrics`) uses a *different* cloned
  communicator from in-step traffic (see `Communicator.device_comm`), so a host collective
  issued while a step is still running asynchronously can never be matched with it.

This is also the one place that maps numpy dtypes to MPI datatypes (`mpi_datatype`) and
knows which ones MPI cannot sum (`NO_MPI_DATATYPE`, `sum_dtype`); `mnjax.comm._collectives`
and `mnjax.comm._wire` build on it. (Host collectives hand numpy buffers to mpi4py, which
types them itself: `mnjax.comm._host`.)

The GPU path depends on mpi4jax's FFI handler names and attributes, pinned in
pyproject.toml (mpi4jax==0.9.1.post2), and on its CUDA extension and copy mode, which
`mnjax.comm._cuda_mpi` checks and sets explicitly.
"""

from __future__ import annotations

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
from mnjax.comm import _native as native
from mnjax.comm import _recorder as recorder
from mnjax.comm._compat import abstract_token, to_dtype_handle, to_mpi_handle

__all__ = [
    "NO_MPI_DATATYPE", "after_operand", "allgather", "allreduce_sum", "alltoall",
    "mpi_datatype", "sum_dtype",
]

#: The numpy dtypes MPI has no datatype for: the 16-bit floats. They move as their raw
#: 16-bit words (`mpi_datatype`; fine for alltoall/allgather, which only move bits) and are
#: summed as float32 (`sum_dtype`), never by MPI in 16 bits.
NO_MPI_DATATYPE: tuple[np.dtype, ...] = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))



def _handle(comm: MPI.Comm) -> int:
  return int(to_mpi_handle(comm))


def after_operand(after):
  """`after` as an array operand (of a collective, or of the cond/switch around one): the
  first collective of a computation has none and gets a uint8 zero."""
  return jnp.zeros((), jnp.uint8) if after is None else after


def mpi_datatype(dtype) -> np.int64:
  """The MPI datatype handle a buffer of `dtype` moves as (the one dtype-to-MPI mapping of
  the package). 16-bit floats have none (`NO_MPI_DATATYPE`): they travel as uint16 words.

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
  """Sum of `x` over all ranks of `comm`, for use inside `jax.jit` (not differentiable).

  `after`: an array the call must wait for (the previous collective's result), so that
  every rank issues its collectives in one order.

  Example:
    >>> total = jax.jit(lambda v: allreduce_sum(v, comm.device_comm))(jnp.ones(3))
    >>> total.tolist() == [comm.size] * 3
    True
  """
  return _allreduce_p.bind(x, after_operand(after), comm_handle=_handle(comm),
                           tag=recorder.tag_for_bind())


def alltoall(x, comm: MPI.Intracomm, after=None):
  """Row ``j`` of `x` goes to rank ``j``; row ``j`` of the result came from rank ``j``.

  `x` has shape ``(comm.size, ...)``. Any dtype MPI knows (use ``uint16`` views for 16-bit
  floats). `after` as in `allreduce_sum`.

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


def _cpu(target, attrs, aliases=None):
  """Lowering to an mnjax handler: operands (x, after), one result. A collective traced
  while a timeline records carries its `tag` (`mnjax.comm._recorder`) to the ``_tagged``
  handler; without one it lowers as if the timeline did not exist."""
  def rule(ctx, x, after, *, tag=0, **params):
    native.register()
    kw = {"operand_output_aliases": aliases} if aliases else {}
    extra = {"tag": np.int64(tag)} if tag else {}
    lowering = ffi.ffi_lowering(target + ("_tagged" if tag else ""), has_side_effect=True, **kw)
    return lowering(ctx, x, after, **attrs(ctx, **params), **extra)
  return rule


def _tie(x, after):
  """`x` unchanged bit for bit, but computed from `after`: its first element times
  ``1 + 0 * s``, with ``s`` a finite scalar read from `after`. XLA does not fold ``s * 0``
  for floats (NaN semantics); the select keeps a NaN or Inf in `after` from reaching `x`,
  and multiplying by exactly 1 keeps NaN, Inf and the sign of zero. (An
  ``optimization_barrier`` is not enough: XLA's simplifier drops a barrier operand whose
  output nobody reads when its producer has one user, e.g. `completion_token`'s sum or a
  cond branch's parameter.)"""
  if x.size == 0 or after.size == 0 or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  s = jnp.ravel(after)[0].astype(jnp.float32)
  one = 1.0 + jnp.where(jnp.isfinite(s), s, 0.0) * 0.0  # exactly 1, computed from `after`
  flat = jnp.ravel(x)
  return flat.at[0].multiply(one.astype(x.dtype)).reshape(x.shape)  # x[0] * 1: bit for bit


def _gpu(target, attrs):
  """Lowering to mpi4jax's handler, which takes and returns a token.

  `after` becomes a data dependency here too (`_tie`: the operand's first element is
  recomputed from it), so the MPI call cannot start before the previous collective's result
  exists, whatever schedule XLA:GPU picks on each rank (tokens minted per call order
  nothing, and mpi4jax's handler takes no extra operand). Checked on the HLO lowered for
  ``cuda`` by tests/unit/test_primitives.py; mnjax's payloads are floats (integer ones would
  travel untied).
  """
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
    _cpu("mnjax_mpi_allreduce", _allreduce_attrs, aliases={0: 0}),
    _gpu("mpi_allreduce_ffi", _mpi4jax_allreduce_attrs))
_alltoall_p = _define(
    "mnjax_alltoall", _same,
    _cpu("mnjax_mpi_alltoall", _alltoall_attrs),
    _gpu("mpi_alltoall_ffi", _mpi4jax_pairwise_attrs(_alltoall_attrs)))
_allgather_p = _define(
    "mnjax_allgather", lambda x, *, size, **_: (size, *x.shape),
    _cpu("mnjax_mpi_allgather", _allgather_attrs),
    _gpu("mpi_allgather_ffi", _mpi4jax_pairwise_attrs(_allgather_attrs)))
