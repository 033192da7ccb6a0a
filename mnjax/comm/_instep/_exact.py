"""Sums whose bits do not depend on how the replicas are grouped into processes.

A float sum's last bits depend on its order, and MPI's and XLA's orders depend on the
number of processes. Integer sums do not. Under ``create_communicator(..., replicas=V)``
each gradient bucket is summed as integers:

1. **An agreed scale.** Each replica's largest magnitude gives a binary exponent; a one-hot
   histogram of those exponents is summed (int32, exact) and the highest bin present is
   ``e``, the same on every rank and every layout: every ``|x| < 2 ** e``.
2. **Fixed point in int32 limbs.** ``x * 2 ** (LIMBS * B - e)`` is cut at ``2 ** B`` into
   `LIMBS` integer limbs (float32 powers of two and truncations: exact); the bits below the
   last limb's unit are dropped. ``B = 30 - ceil(log2 V)``, so V limbs sum without
   overflow.
3. **The sum.** The limbs go through the kind's ordinary reduction as int32 (exact,
   associative), then carry (each lower limb into ``[-2 ** (B - 1), 2 ** (B - 1))``) into
   a fixed float32 reconstruction: the same integers give the same bits.

Error, against the exact sum of the V float32 inputs: each replica's value loses less than
one unit of the last limb, ``2 ** (e - LIMBS * B)``, so the integer sum is within
``V * 2 ** (e - LIMBS * B)`` of it, and the reconstruction rounds twice to float32 (at most
``2 ** -23`` relative). With 2 limbs and V <= 16 that is ``16 * 2 ** (e - 52)``: the
smallest entries of a bucket, below ``2 ** (e - 52)``, count as zero (as do float32
subnormals, which XLA's CPU flushes to zero anyway). Cost: a histogram of
`BINS` int32 and two int32 per element on the wire (2x float32's bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["BINS", "LIMBS", "error_bound", "exact_sum", "limb_bits"]

LIMBS = 2
#: ``frexp`` exponents -150 .. 129 (every float32's, and -150 for zero), one bin each.
BINS = 280
_LOWEST = -150


def _pow2(k: jax.Array) -> jax.Array:
  """``2.0 ** k`` in float32, exactly, for int32 ``-126 <= k <= 127``."""
  return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


def _scale(x: jax.Array, n: jax.Array) -> jax.Array:
  """``x * 2 ** n``, exact while the result is a normal float32 (``jnp.ldexp`` is not for
  large `n`): three factors of the same sign, so each partial result lies between `x` and
  the result."""
  n = jnp.asarray(n, jnp.int32)
  for _ in range(3):
    step = jnp.clip(n, -120, 120)
    x = x * _pow2(step)
    n = n - step
  return x


def limb_bits(replicas: int) -> int:
  """Bits per limb for `replicas` summands: V values below ``2 ** B`` sum below ``2 ** 30``.

  Example:
    >>> limb_bits(12), limb_bits(1)
    (26, 30)
  """
  return 30 - math.ceil(math.log2(replicas))


def error_bound(max_abs: float, replicas: int) -> float:
  """The largest absolute error of an exact sum whose inputs' largest magnitude is
  `max_abs`, before the final float32 rounding (module docstring).

  Example:
    >>> error_bound(1.0, 12) == 12 * 2.0 ** (1 - 2 * 26)
    True
  """
  e = math.frexp(max_abs)[1] if max_abs else 0
  return replicas * 2.0 ** (e - LIMBS * limb_bits(replicas))


def exact_sum(buf: jax.Array, replicas: int,
              reduce: Callable[[jax.Array, jax.Array | None], jax.Array],
              after: jax.Array | None) -> jax.Array:
  """The sum of `buf` (float32) over `replicas` replicas through `reduce` (the kind's int32
  sum, ``reduce(x, after)``), the same bits however the replicas sit on processes.

  Example:
    >>> exact_sum(jnp.array([1.5, -2.0]), 1, lambda x, after: x, None)
    Array([ 1.5, -2. ], dtype=float32)
  """
  if buf.dtype != jnp.float32:
    raise ValueError(f"exact sums take float32 buffers, got {buf.dtype}.")
  bits = limb_bits(replicas)
  # 1. The agreed exponent: every replica's, summed as a histogram.
  largest = jnp.max(jnp.abs(buf)) if buf.size else jnp.zeros((), jnp.float32)
  _, exponent = jnp.frexp(largest)  # largest < 2 ** exponent (0 for 0)
  exponent = jnp.where(largest > 0, exponent, _LOWEST)
  hist = (jnp.arange(BINS, dtype=jnp.int32) == exponent - _LOWEST).astype(jnp.int32)
  counts = reduce(hist, after)
  e = jnp.max(jnp.where(counts > 0, jnp.arange(BINS, dtype=jnp.int32), 0)) + _LOWEST
  # 2. Limbs: x < 2 ** (LIMBS * bits), most significant first.
  x = _scale(buf, LIMBS * bits - e)
  limbs = []
  for k in reversed(range(LIMBS)):
    limb = jnp.trunc(_scale(x, -k * bits))
    x = x - _scale(limb, k * bits)
    limbs.append(limb.astype(jnp.int32))
  # 3. One int32 sum of every limb, then carries and a fixed reconstruction.
  sums = reduce(jnp.concatenate(limbs), counts)
  parts = [sums[i * buf.size:(i + 1) * buf.size] for i in range(LIMBS)]
  unit, half = 1 << bits, 1 << (bits - 1)
  for i in reversed(range(1, LIMBS)):  # parts[i] into [-unit/2, unit/2), carry upwards:
    carry = jnp.floor_divide(parts[i] + half, unit)  # a small sum stays small, and exact
    parts[i] = parts[i] - carry * unit
    parts[i - 1] = parts[i - 1] + carry
  total = jnp.zeros(buf.shape, jnp.float32)
  for i, part in enumerate(parts):  # most significant first
    total = total + _scale(part.astype(jnp.float32), (LIMBS - 1 - i) * bits)
  return _scale(total, e - LIMBS * bits)
