"""Sums with the same bits whatever the process layout (docs/design/allreduce.md, Exact sums)."""

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
  """``x * 2 ** n`` in three same-sign steps, exact while normal (unlike ``jnp.ldexp``, large n)."""
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
  """The largest error of an exact sum of inputs up to `max_abs`, before float32 rounding.

  Example:
    >>> error_bound(1.0, 12) == 12 * 2.0 ** (1 - 2 * 26)
    True
  """
  e = math.frexp(max_abs)[1] if max_abs else 0
  return replicas * 2.0 ** (e - LIMBS * limb_bits(replicas))


def exact_sum(buf: jax.Array, replicas: int,
              reduce: Callable[[jax.Array, jax.Array | None], jax.Array],
              after: jax.Array | None) -> jax.Array:
  """The sum of float32 `buf` over `replicas` through the kind's int32 ``reduce(x, after)``.

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
