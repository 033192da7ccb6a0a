"""Half precision on the wire: ChainerMN's ``allreduce_grad_dtype``, Horovod's fp16 compression.

Values scaled by ``1/p`` travel as raw 16-bit words, summed in float32 (docs/design/allreduce.md);
NaN and Inf stay; a finite value beyond fp16's range becomes Inf. Error of ``m = sum_i x_i / p``:

    |computed - m| <= (2 u + p 2^-24) * (sum_i |x_i|) / p + (p + 1) * eta

``u``: the wire dtype's unit roundoff (bfloat16 2^-8, float16 2^-11); ``eta``: half its
smallest subnormal step (float16 2^-25, bfloat16 2^-134). Times ``p`` for ``mean=False``."""

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
  """A 16-bit `wire_dtype` as a numpy dtype, None for None/float32/float64; else a ValueError.

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
  """Worst-case absolute error per element of a 16-bit allreduce over ``p`` `replicas`, given
  `abs_sum` (``sum_i |x_i|``, array or scalar); of the sum if not `mean` (module docstring).

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
  """Sum over `parts` ranks of a 1-D float `buf` (scaled by the caller) as `wire_dtype`, through
  `alltoall` (``(parts, c)`` to the chunks received) and `allgather` (``(c,)`` to ``(parts, c)``).

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
  for row in range(1, parts):  # row adds: faster than jnp.sum on XLA:CPU
    total = total + received[row].astype(jnp.float32)
  gathered = allgather(total.astype(wire_dtype)).reshape(-1)
  return gathered[:n] if pad else gathered
