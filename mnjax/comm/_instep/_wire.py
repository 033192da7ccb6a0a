"""Half precision on the wire: ChainerMN's ``allreduce_grad_dtype``, Horovod's fp16 compression.

MPI has no 16-bit float type, so the allreduce moves raw 16-bit words with float32 arithmetic:
(1) scale by ``1/replicas`` and round to the wire dtype while packing, so what travels sums
to the mean; (2) an alltoall, each rank summing the ``p`` copies of its chunk in float32;
(3) round and allgather, widening while unpacking. NaN and Inf stay so; a finite value beyond
fp16's range becomes Inf.

Error bound per element for the mean ``m = sum_i x_i / p`` (`error_bound`):

    |computed - m| <= (2 u + p 2^-24) * (sum_i |x_i|) / p + (p + 1) * eta

with ``u`` the wire dtype's unit roundoff (bfloat16 2^-8, float16 2^-11) and ``eta`` half
its smallest subnormal step (float16 2^-25; bfloat16 2^-134, negligible). With
``mean=False`` multiply the bound by ``p``. Multi-device kinds first sum over local devices
in float32, which only tightens it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WIRE_DTYPES", "check_wire_dtype", "error_bound", "half_allreduce"]

WIRE_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

_UNIT_ROUNDOFF = {np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11}
_HALF_SUBNORMAL_STEP = {np.dtype(jnp.bfloat16): 2.0**-134, np.dtype(jnp.float16): 2.0**-25}


def check_wire_dtype(wire_dtype: Any, caller: str) -> np.dtype | None:
  """`wire_dtype` as a numpy dtype, or None for full precision, or a ValueError.

  None, float32 and float64 mean full precision (every leaf in its own dtype); float64 needs
  ``jax_enable_x64``.

  Example:
    >>> check_wire_dtype(jnp.bfloat16, "allreduce_gradients")
    dtype(bfloat16)
    >>> with jax.enable_x64(True):
    ...   print(check_wire_dtype(jnp.float64, "allreduce_gradients"))
    None
  """
  if wire_dtype is None:
    return None
  try:
    dtype = np.dtype(wire_dtype)
  except TypeError:
    dtype = None
  if dtype is not None and dtype == np.dtype(np.float32):
    return None
  if dtype is not None and dtype == np.dtype(np.float64):
    if not jax.config.jax_enable_x64:
      raise ValueError(
          f"{caller}: wire_dtype=float64 needs jax_enable_x64, which is off: JAX then makes"
          " every float64 a float32, so there are no float64 gradients to send. Enable it"
          " before creating any array (jax.config.update('jax_enable_x64', True), or"
          " JAX_ENABLE_X64=1) for a float64 model, or pass wire_dtype=None (each gradient"
          " travels in its own dtype).")
    return None
  if dtype not in WIRE_DTYPES:
    raise ValueError(
        f"{caller}: wire_dtype must be None (gradients travel in their own dtype),"
        f" jnp.float64 (the same, for a float64 model under jax_enable_x64), jnp.bfloat16 or"
        f" jnp.float16, got {wire_dtype!r}. bfloat16 keeps float32's range (recommended);"
        " float16 is more precise but overflows above 65504."
    )
  return dtype


def error_bound(abs_sum: Any, replicas: int, wire_dtype: Any, *, mean: bool = True) -> Any:
  """Worst-case absolute error of a half-precision allreduce, per element (module docstring).

  Args:
    abs_sum: ``sum_i |x_i|`` over replicas, per element (array or scalar).
    replicas: number of replicas ``p``.
    wire_dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    mean: the bound for the mean (default) or for the sum.

  Example:
    >>> float(error_bound(4.0, 2, jnp.bfloat16))   # mean of two values, |x0| + |x1| = 4
    0.015625...
  """
  dtype = np.dtype(wire_dtype)
  u, eta = _UNIT_ROUNDOFF[dtype], _HALF_SUBNORMAL_STEP[dtype]
  bound = (2 * u + replicas * 2.0**-24) * np.asarray(abs_sum, np.float64) / replicas
  bound = bound + (replicas + 1) * eta
  return bound if mean else bound * replicas


def half_allreduce(
    buf: jax.Array,
    wire_dtype: np.dtype,
    parts: int,
    alltoall: Callable[[jax.Array], jax.Array],
    allgather: Callable[[jax.Array], jax.Array],
) -> jax.Array:
  """Sum over `parts` ranks of a 1-D float `buf`, moved and returned as `wire_dtype` (traceable).

  `alltoall` maps a ``(parts, c)`` array of `wire_dtype` to the ``(parts, c)`` array of
  chunks received from each rank; `allgather` maps ``(c,)`` to ``(parts, c)``. They move
  raw 16-bit words. The caller scales `buf` beforehand. The float32 sum is a chain of row
  adds (faster than ``jnp.sum`` on XLA:CPU, docs/design/allreduce.md).

  Example:
    >>> from mnjax.comm._instep import _primitives as mpi
    >>> c = comm.device_comm
    >>> total = jax.jit(lambda buf: half_allreduce(buf, jnp.bfloat16, comm.size,
    ...     lambda x: mpi.alltoall(x, c), lambda x: mpi.allgather(x, c)))(jnp.full(5, 1.5))
    >>> total.dtype, total.tolist() == [1.5 * comm.size] * 5
    (dtype(bfloat16), True)
  """
  n = buf.size
  pad = (-n) % parts
  if pad:
    buf = jnp.pad(buf, (0, pad))
  received = alltoall(buf.astype(wire_dtype).reshape(parts, -1))
  total = received[0].astype(jnp.float32)
  for row in range(1, parts):
    total = total + received[row].astype(jnp.float32)
  gathered = allgather(total.astype(wire_dtype)).reshape(-1)
  return gathered[:n] if pad else gathered
