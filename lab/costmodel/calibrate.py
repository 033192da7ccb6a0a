"""Calibrate the model's link and software overhead from `python -m lab.bench allreduce`.

The benchmark JSON holds, per message size, the time of raw MPI on numpy buffers and of
mnjax's in-step allreduce. Fitting ``t = 2 (p-1) alpha + 2 (p-1)/p n / B`` to a method's
sweep gives its latency ``alpha`` (messages up to 1 kB) and bandwidth ``B`` (32 MB and up:
gradient sizes, beyond the caches). mnjax's software overhead is what it adds
to raw MPI: a per-call cost (small messages) and a packing bandwidth (ResNet-50's 161
leaves in mnjax's default 4 MB buckets against raw MPI on one ready buffer).

    >>> from lab.costmodel import calibrate
    >>> cal = calibrate.from_allreduce_json("docs/results/bench/allreduce.json")  # doctest: +SKIP
    >>> cal.link.bandwidth > 0, cal.software.per_call > 0                        # doctest: +SKIP
    (True, True)
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np

from lab.costmodel.hardware import Cluster, Link
from lab.costmodel.step import Software


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A measured machine: its link as the alpha-beta model sees it, and mnjax's overhead."""

  ranks: int
  link: Link
  raw_link: Link
  software: Software

  def cluster(self, ranks: int | None = None) -> Cluster:
    """This machine as one node of `ranks` processes joined by the calibrated link."""
    p = ranks or self.ranks
    return Cluster("this machine", 1, p, self.raw_link, self.raw_link)


def fit_alpha_beta(nbytes, seconds, ranks: int, *, small: float = 1024,
                   large: float = 32 << 20) -> tuple[float, float]:
  """``(alpha, bandwidth)`` of ``t = 2 (p-1) alpha + 2 (p-1)/p n / B`` for a size sweep.

  Two regimes, fitted apart: messages up to `small` bytes are pure latency (alpha: their
  median time over the ``2 (p-1)`` steps); from `large` bytes on, a least-squares line gives
  the bandwidth. In between, caches make a CPU's shared-memory transfers faster than either.
  """
  n = np.asarray(nbytes, float)
  t = np.asarray(seconds, float)
  if n.shape != t.shape or np.any(t <= 0) or ranks < 2:
    raise ValueError(f"need (bytes, seconds > 0) points and ranks >= 2; got {n.size} "
                     f"bytes, {t.size} times, ranks={ranks}")
  steps = 2 * (ranks - 1)
  lat, big = n <= small, n >= large
  if lat.sum() < 1 or big.sum() < 2:
    raise ValueError(f"the sweep needs a message of <= {small:.0f} B and two of >= "
                     f"{large:.0f} B (python -m lab.bench allreduce covers 4 B-128 MB); "
                     f"got sizes {n.astype(int).tolist()}")
  alpha = float(np.median(t[lat])) / steps
  slope, _ = np.polyfit(n[big], t[big], 1)
  if slope <= 0:
    raise ValueError("the sweep's time does not grow with the message size from "
                     f"{large:.0f} B on; rerun the benchmark with more rounds")
  return alpha, steps / ranks / float(slope)


def _link(name: str, alpha: float, bandwidth: float) -> Link:
  return Link(name, bandwidth * 8 / 1e9, 1.0, alpha)


def from_allreduce_json(source, method: str = "mnjax_fp32") -> Calibration:
  """A `Calibration` from the JSON (a path or the loaded dict) ``bench allreduce`` wrote."""
  data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
  try:
    ranks = data["mpi"]["ranks"]
    sweep = data["mpi"]["sweep"]
    resnet = data["mpi"]["resnet50"]
  except (KeyError, TypeError):
    raise ValueError("not a `python -m lab.bench allreduce` result: it needs "
                     "mpi.ranks, mpi.sweep and mpi.resnet50") from None
  if method not in sweep[0]["seconds"]:
    raise ValueError(f"method {method!r} is not in the sweep; it has "
                     f"{', '.join(sweep[0]['seconds'])}")
  sizes = [row["bytes"] for row in sweep]
  raw = fit_alpha_beta(sizes, [row["seconds"]["raw_mpi"] for row in sweep], ranks)
  ours = fit_alpha_beta(sizes, [row["seconds"][method] for row in sweep], ranks)
  small = [row["seconds"][method] - row["seconds"]["raw_mpi"] for row in sweep
           if row["bytes"] <= 1024]
  per_call = max(0.0, statistics.median(small)) if small else 0.0
  # Packing: ResNet-50's 161 leaves in mnjax's default 4 MB buckets against raw MPI on one
  # ready buffer. (One fused 102 MB buffer would also count glibc's fresh-page faults.)
  gradient_bytes = 25_557_032 * 4
  extra = resnet.get("mnjax_bucket_4MB", 0.0) - resnet.get("raw_mpi_fused", 0.0)
  pack = 2 * gradient_bytes / extra if extra > 0 else None
  return Calibration(ranks, _link(f"measured {method}", *ours), _link("measured raw MPI", *raw),
                     Software(per_call=per_call, pack_bandwidth=pack))
