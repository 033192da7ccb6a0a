"""The memory section of ``python -m mnjax.bench aot``: per GPU, by batch, allreduce_gradients
+ adam against shard_optimizer(adam), and the largest batch that fits (`mnjax.bench.aot`)."""

from __future__ import annotations

import re


def device_memory(gpu: str) -> int:
  """Bytes of `gpu`'s memory, from its target file.

  Example:
    >>> device_memory("H200") / 1e9
    151.397597184
  """
  from mnjax import aot

  return int(re.search(r"device_memory_size:\s*(\d+)", aot.target_config(gpu)).group(1))


def memory(compile_at, batches, memory_bytes: float, search: bool) -> dict:
  """``compile_at(batch, adam=True, shard=...)`` (`mnjax.bench.aot`'s flat kind) at each of
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


def largest_batch(compile_at, rows: dict, memory_bytes: float, search: bool) -> dict:
  """The largest batch whose peak fits: an affine fit of the peak in the batch, then (with
  `search`) compiled and moved one image at a time until the boundary is found (at most 4
  compiles; 2 when the fit is right): ``largest`` is the largest compiled batch that fits,
  ``boundary_found`` whether one more image was compiled and does not.

  Example:
    >>> rows = {32: {"peak_bytes": 4.0e9}, 64: {"peak_bytes": 7.0e9}}
    >>> largest_batch(None, rows, 100e9, search=False)["predicted"]
    1056
  """
  import numpy as np

  points = [(b, r["peak_bytes"]) for b, r in rows.items() if "peak_bytes" in r]
  if len(points) < 2:
    return {"error": "fewer than two compiled batches"}
  slope, base = np.polyfit(*zip(*points), 1)
  guess = int((memory_bytes - base) // slope)
  result = {"per_image_bytes": float(slope), "fixed_bytes": float(base), "predicted": guess}
  if not search:
    return result
  peaks = {}

  def peak(b):
    if b not in peaks:
      peaks[b] = compile_at(b).get("peak_bytes", float("inf"))
    return peaks[b]

  b = guess
  if peak(b) <= memory_bytes:
    while peak(b + 1) <= memory_bytes and len(peaks) < 4:
      b += 1
  else:
    while b > 1 and peak(b) > memory_bytes and len(peaks) < 4:
      b -= 1
  fits = [k for k, v in peaks.items() if v <= memory_bytes]
  b = max(fits, default=None)
  result.update(compiled={int(k): int(v) if v != float("inf") else None
                          for k, v in sorted(peaks.items())},
                largest=b, boundary_found=b is not None and peaks.get(b + 1, 0) > memory_bytes)
  return result
