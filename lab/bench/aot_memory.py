"""The memory section of ``python -m lab.bench aot``: per GPU, by batch, allreduce_gradients
+ adam against shard_optimizer(adam), and the largest batch that fits (`lab.bench.aot`)."""

from __future__ import annotations

import re


def device_memory(gpu: str) -> int:
  """Bytes of `gpu`'s memory, from its target file.

  Example:
    >>> device_memory("H200") / 1e9
    151.397597184
  """
  from lab import aot

  return int(re.search(r"device_memory_size:\s*(\d+)", aot.target_config(gpu)).group(1))


def memory(compile_at, batches, memory_bytes: float, search: bool) -> dict:
  """``compile_at(batch, adam=True, shard=...)`` (`lab.bench.aot`'s flat kind) at each of
  `batches`, for both optimizers, and each one's largest batch (`largest_batch`)."""
  rows = {"allreduce_adam": {}, "shard_optimizer_adam": {}}
  for b in batches:  # both optimizers at each batch, smallest first
    for label, shard in (("allreduce_adam", False), ("shard_optimizer_adam", True)):
      rows[label][b] = compile_at(b, adam=True, shard=shard)
  out = {"kind": "flat", "memory_bytes": memory_bytes, "by_batch": rows, "max_batch": {}}
  for label, shard in (("allreduce_adam", False), ("shard_optimizer_adam", True)):
    out["max_batch"][label] = largest_batch(
        lambda b, shard=shard: compile_at(b, adam=True, shard=shard), rows[label],
        memory_bytes, search)
  return out


#: Compiles `largest_batch` may spend finding the boundary (each one a whole ResNet-50 step).
SEARCH_COMPILES = 12


def largest_batch(compile_at, rows: dict, memory_bytes: float, search: bool,
                  budget: int = SEARCH_COMPILES) -> dict:
  """The largest batch whose peak fits: an affine fit of the peak in the batch, then (with
  `search`) compiled at the prediction and, galloping away from it in steps of 1, 2, 4, ...
  images, until one batch fits and a larger one does not; bisected between the two. At most
  `budget` compiles. ``largest`` is the largest compiled batch that fits below the first
  compiled one that does not, ``boundary_found`` whether ``largest + 1`` was compiled and does
  not fit (XLA's peak is not monotonic in the batch to the image: a boundary, not the only one).

  Example:
    >>> rows = {32: {"peak_bytes": 4.0e9}, 64: {"peak_bytes": 7.0e9}}
    >>> largest_batch(None, rows, 100e9, search=False)["predicted"]
    1056
    >>> fake = lambda b: {"peak_bytes": 1e9 + b * 0.1e9}   # the fit is 20 images too low
    >>> r = largest_batch(fake, {32: fake(52), 64: fake(84)}, 100e9, search=True)
    >>> r["predicted"], r["largest"], r["boundary_found"]
    (970, 990, True)
  """
  import numpy as np

  points = [(b, r["peak_bytes"]) for b, r in rows.items() if "peak_bytes" in r]
  if len(points) < 2:
    return {"error": "fewer than two compiled batches"}
  slope, base = np.polyfit(*zip(*points), 1)
  guess = max(1, int((memory_bytes - base) // slope))
  result = {"per_image_bytes": float(slope), "fixed_bytes": float(base), "predicted": guess}
  if not search:
    return result
  peaks = {}

  def fits(b):
    if b not in peaks:
      peaks[b] = compile_at(b).get("peak_bytes", float("inf"))
    return peaks[b] <= memory_bytes

  lo = hi = None  # the largest batch known to fit, the smallest known not to
  step = 1
  if fits(guess):
    lo = guess
    while hi is None and len(peaks) < budget:
      b = lo + step
      lo, hi = (b, None) if fits(b) else (lo, b)
      step *= 2
  else:
    hi = guess
    while lo is None and hi > 1 and len(peaks) < budget:
      b = max(1, hi - step)
      lo, hi = (b, hi) if fits(b) else (None, b)
      step *= 2
  while lo is not None and hi is not None and hi - lo > 1 and len(peaks) < budget:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  result.update(compiled={int(k): int(v) if v != float("inf") else None
                          for k, v in sorted(peaks.items())},
                largest=lo, boundary_found=lo is not None and hi == lo + 1)
  return result
