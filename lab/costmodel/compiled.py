"""The cost model fed by the compiler: compute time from XLA's cost analysis, overlap from the
compiled schedule (``python -m lab.bench aot``).

`step` assumes a step's compute time and how much of the exchange hides behind it. Compiled
for a GPU (`lab.aot`), the step says both itself:

* **compute**: the compiled program's flops (XLA's cost analysis of the lowered program) and
  bytes (of the fused one: each kernel's operands and results, an estimate of the HBM
  traffic) give two lower bounds, ``flops / peak`` and ``bytes / HBM bandwidth``; the step
  cannot be faster than the larger (`compute_time` names it). A roofline bound, not a
  measurement: real kernels reach a fraction of either peak, so real steps are longer and
  their communication easier to hide;
* **overlap**: the share of the gradient bytes whose all-reduce XLA scheduled beside compute
  (`lab.aot.Schedule.overlap`), with the all-reduces as XLA left them after combining;
  `predict` hides that share of their time behind the compute, the rest shows.

GPU peaks (dense, no sparsity) from NVIDIA's H100 and H200 SXM datasheets: FP32 67 TFLOP/s,
TF32 tensor cores 494.5 (989 with sparsity), BF16 989.5 (1,979 with sparsity); HBM 3.35 TB/s
(H100 SXM5) and 4.8 TB/s (H200). XLA computes float32 convolutions and matrix products on
tensor cores in TF32 by default (JAX's default precision), so TF32 is the float32 peak.

    >>> from lab.costmodel import compiled, hardware as hw
    >>> t = compiled.compute_time(4.0e11, 2.0e10, "H200")
    >>> t.bound, round(t.seconds * 1e3, 2)
    ('bytes', 4.17)
"""

from __future__ import annotations

import dataclasses

from lab.costmodel.allreduce import kind_time
from lab.costmodel.hardware import Cluster

__all__ = ["GPUS", "ComputeTime", "Gpu", "compute_time", "predict", "step_time"]


@dataclasses.dataclass(frozen=True)
class Gpu:
  """A GPU's peaks: flop/s per precision (dense) and HBM bytes/s."""

  name: str
  flops: dict
  hbm_bandwidth: float


GPUS = {
    "H100": Gpu("H100 SXM5", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}, 3.35e12),
    "H200": Gpu("H200 SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}, 4.8e12),
}


@dataclasses.dataclass(frozen=True)
class ComputeTime:
  """The two roofline bounds of a step and the larger, which the model uses."""

  flops_seconds: float
  bytes_seconds: float

  @property
  def seconds(self) -> float:
    return max(self.flops_seconds, self.bytes_seconds)

  @property
  def bound(self) -> str:
    return "flops" if self.flops_seconds >= self.bytes_seconds else "bytes"


def compute_time(flops: float, bytes_accessed: float, gpu: str | Gpu, *,
                 precision: str = "tf32") -> ComputeTime:
  """``flops / peak`` and ``bytes / HBM bandwidth`` of one step on `gpu` (a name of `GPUS`).

  >>> compute_time(989.5e9, 0.0, "H200", precision="bf16").flops_seconds
  0.001
  """
  g = GPUS[gpu.upper()] if isinstance(gpu, str) else gpu
  if precision not in g.flops:
    raise ValueError(f"precision must be one of {sorted(g.flops)}, got {precision!r}")
  return ComputeTime(flops / g.flops[precision], bytes_accessed / g.hbm_bandwidth)


@dataclasses.dataclass(frozen=True)
class StepTime:
  compute: float  # the GPU's own work
  comm: float     # every gradient all-reduce of the step, back to back
  exposed: float  # what the step waits for beyond `compute`

  @property
  def total(self) -> float:
    return self.compute + self.exposed


def step_time(compute: float, allreduce_bytes: list[float], overlap: float, c: Cluster, *,
              kind: str = "xla", interference: float = 0.0) -> StepTime:
  """The step on every GPU of `c`: the compiled gradient all-reduces (`allreduce_bytes`, as
  XLA combined them) take ``comm``; the `overlap` share of it hides behind `compute` (at
  most all of `compute`), paying `interference` of itself; the rest shows.

  >>> from lab.costmodel import hardware as hw
  >>> c = hw.cluster("h200_ndr", gpus=64)
  >>> hidden, exposed = (step_time(0.01, [25e6, 25e6], o, c) for o in (1.0, 0.0))
  >>> hidden.exposed, exposed.exposed > 0
  (0.0, True)
  """
  if not 0 <= overlap <= 1:
    raise ValueError(f"overlap must be a share in [0, 1], got {overlap!r}")
  if c.gpus == 1:
    return StepTime(compute, 0.0, 0.0)
  comm = sum(kind_time(kind, b, c) for b in allreduce_bytes)
  hidden = min(overlap * comm, compute)
  return StepTime(compute, comm, comm - hidden + interference * hidden)


def predict(compute: float, allreduce_bytes: list[float], overlap: float, c: Cluster,
            gpus: list[int], **options) -> list[float]:
  """Weak-scaling efficiency at each GPU count of `gpus` (`step_time` of one GPU, which
  exchanges nothing, over that of p GPUs of `c`'s nodes).

  >>> from lab.costmodel import hardware as hw
  >>> c = hw.cluster("h200_ndr")
  >>> [round(e, 3) for e in predict(0.012, [25e6] * 4, 1.0, c, [8, 1024])]
  [1.0, 1.0]
  """
  return [compute / step_time(compute, allreduce_bytes, overlap, c.with_gpus(p),
                              **options).total for p in gpus]
