"""Published scaling results, with the model's inputs for each and where every input comes from.

`validate()` runs the model on each case and returns the predicted and published figures
side by side; ``tests/unit/test_costmodel.py`` requires every prediction inside its tolerance
before the notebooks use the model to predict anything.

Inputs marked "assumed" are not stated in the sources; the figure used is a typical one for
the hardware and software of the time, and the notebook shows how the prediction moves
with it. Two inputs are shared by every case instead of being set per case: the TCP
efficiency of the Ethernet presets (`hardware.ETH_*`, 60% of line rate) and
`INTERFERENCE`.

    >>> from lab.costmodel import published
    >>> rows = published.validate()
    >>> all(r.ok for r in rows)
    True
"""

from __future__ import annotations

import dataclasses
import functools

from lab.costmodel import allreduce
from lab.costmodel import hardware as hw
from lab.costmodel.step import RESNET50, RESNET101, Software, Workload, efficiency, step_time

# The fraction of overlapped communication time that still lands on the step (stacks of
# 2017-2018: Gloo/NCCL over TCP competing with the computation for PCIe, memory and host
# CPU). Assumed: set once for every case with overlap (Goyal et al., Horovod, ChainerMN's
# double buffering); 0 would be perfect overlap.
INTERFERENCE = 0.2

# ChainerMN's hierarchical communicator: NCCL reduce to one GPU, MPI allreduce between
# nodes, NCCL broadcast (about one intra-node allreduce in all).
CHAINERMN_HIERARCHICAL = functools.partial(allreduce.hierarchical, intra_allreduces=1)


@dataclasses.dataclass(frozen=True)
class Case:
  """One published figure: what the model predicts for it and the range it must land in."""

  name: str
  source: str
  published: str
  low: float
  high: float
  predict: object  # () -> float
  inputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  source: str
  published: str
  predicted: float
  low: float
  high: float

  @property
  def ok(self) -> bool:
    return self.low <= self.predicted <= self.high


# --- ChainerMN 2017: ResNet-50, 128 GPUs -------------------------------------------------
CHAINERMN_CLUSTER = hw.PRESETS["chainermn_2017"]  # 32 nodes x 4 TITAN X, PCIe, FDR (paper)
# 32 images per GPU (paper). Step compute, assumed: 70-100 images/s is the range for a
# Maxwell GTX TITAN X in the frameworks of 2017; the middle, 86 images/s, is 0.37 s per 32.
CHAINERMN_RESNET50 = RESNET50.replace(compute=0.37, batch_per_gpu=32)


def chainermn_2017(compute: float = CHAINERMN_RESNET50.compute) -> float:
  """Efficiency at 128 GPUs vs 1, no overlap, fp32, one fused buffer (ChainerMN packs all)."""
  return efficiency(CHAINERMN_RESNET50.replace(compute=compute), CHAINERMN_CLUSTER,
                    CHAINERMN_HIERARCHICAL)


# --- Goyal et al. 2017: ResNet-50, 256 GPUs, 8k minibatch ---------------------------------
GOYAL_CLUSTER = hw.PRESETS["big_basin_50gbe"]  # 32 x 8 P100 NVLink, 50 GbE (paper, sec. 5)
# 32 images per GPU (paper). Step compute, derived from the paper: 90 epochs of ImageNet
# (1.28M images) on 8 GPUs take 29 hours, 0.232 s per 32-image step including the
# in-server allreduce (the model adds the latter back in its 8-GPU reference).
GOYAL_RESNET50 = RESNET50.replace(compute=0.232, batch_per_gpu=32)
# Caffe2 + Gloo: NCCL-style reduce within the server, recursive halving/doubling between
# servers (paper), one allreduce per parameter blob as the backward pass produces it
# (ResNet-50 has 161: buckets of n/161 bytes), overlapped with the backward pass.
GOYAL_BUCKETS = RESNET50.params * 4 / 161


def goyal_2017(interference: float = INTERFERENCE) -> float:
  """Efficiency at 256 GPUs vs 8 (one server), as the paper reports it (~90%)."""
  return efficiency(GOYAL_RESNET50, GOYAL_CLUSTER, CHAINERMN_HIERARCHICAL, reference=8,
                    overlap="backward", bucket_bytes=GOYAL_BUCKETS, interference=interference)


# --- Horovod 2018: ResNet-101, 128 GPUs, 25 GbE -------------------------------------------
HOROVOD_CLUSTER = hw.PRESETS["horovod_25gbe"]  # 32 x 4 Pascal GPUs, 25 GbE TCP (paper)
# 64 images per GPU (tf_cnn_benchmarks' default for ResNet-101). Step compute, assumed:
# ~125 images/s on a P100 in TensorFlow 1.x (0.51 s per 64 images).
HOROVOD_RESNET101 = RESNET101.replace(compute=0.51, batch_per_gpu=64)
# Horovod: NCCL 2 ring over all GPUs, tensor fusion into 64 MB buffers, a 5 ms coordination
# cycle per fused allreduce (Horovod's defaults), overlapped with the backward pass.
HOROVOD_SOFTWARE = Software(per_call=5e-3)
# NCCL before 2.4 (release notes of 2.4.2, early 2019) had rings only; both 2018 cases ran
# on it, so they model "xla" as the ring alone (the tree would move Horovod's 0.849 to 0.860).
NCCL_2018 = "ring"


def horovod_2018(interference: float = INTERFERENCE) -> float:
  """Efficiency at 128 GPUs vs 1 (the paper: 88% for Inception V3 and ResNet-101)."""
  return efficiency(HOROVOD_RESNET101, HOROVOD_CLUSTER, "xla", overlap="backward",
                    bucket_bytes=64 << 20, interference=interference,
                    software=HOROVOD_SOFTWARE, nccl=NCCL_2018)


# --- ChainerMN v1.3 (2018): 10 GbE against InfiniBand FDR ---------------------------------
# Chainer blog, "New ChainerMN functions for improved performance in cloud environments"
# (2018-05-25): double buffering and an FP16 allreduce, both on the pure_nccl communicator
# (NCCL ring over every GPU). Assumed: 4 nodes x 8 V100 on NVLink 2, ResNet-50 at 32
# images per GPU, 0.085 s per step (~375 images/s per V100 in fp32).
CHAINERMN13_FDR = hw.Cluster("4 x 8 V100, FDR", 4, 8, hw.NVLINK2, hw.IB_FDR)
CHAINERMN13_10GBE = dataclasses.replace(CHAINERMN13_FDR, name="4 x 8 V100, 10 GbE",
                                        inter=hw.ETH_10G)
CHAINERMN13_RESNET50 = RESNET50.replace(compute=0.085, batch_per_gpu=32)


def chainermn13_slowdown(w: Workload = CHAINERMN13_RESNET50) -> float:
  """10 GbE step time / FDR step time, both plain (fp32, no overlap): "about 3x slower"."""
  return (step_time(w, CHAINERMN13_10GBE, "xla", nccl=NCCL_2018).total
          / step_time(w, CHAINERMN13_FDR, "xla", nccl=NCCL_2018).total)


def chainermn13_tuned(w: Workload = CHAINERMN13_RESNET50,
                      interference: float = INTERFERENCE) -> float:
  """10 GbE with fp16 allreduce + double buffering, over plain FDR: "within ~11%"."""
  tuned = step_time(w, CHAINERMN13_10GBE, "xla", wire_bytes=2, overlap="double_buffering",
                    interference=interference, nccl=NCCL_2018)
  return tuned.total / step_time(w, CHAINERMN13_FDR, "xla", nccl=NCCL_2018).total


CASES = (
    Case("ChainerMN, ResNet-50, 128 GPUs (32 x 4, FDR, no overlap)",
         "Akiba, Fukuda, Suzuki 2017 (arXiv:1710.11351)", "78-90% efficiency",
         0.78, 0.90, chainermn_2017,
         ("cluster: paper", "32 img/GPU: paper", "0.37 s step: assumed (0.32-0.46 s)")),
    Case("Goyal et al., ResNet-50, 256 GPUs (32 x 8, 50 GbE, overlap), vs 8 GPUs",
         "Goyal et al. 2017 (arXiv:1706.02677)", "~90% efficiency",
         0.85, 0.95, goyal_2017,
         ("cluster: paper", "0.232 s step: paper's 29 h on 8 GPUs",
          "per-blob allreduce, halving/doubling: paper", "interference 0.2: assumed")),
    Case("Horovod, ResNet-101, 128 GPUs (32 x 4, 25 GbE, overlap)",
         "Sergeev & Del Balso 2018 (arXiv:1802.05799)", "88% efficiency",
         0.83, 0.93, horovod_2018,
         ("cluster: paper", "64 MB fusion, 5 ms cycle: Horovod defaults",
          "0.51 s step: assumed", "interference 0.2: assumed")),
    Case("ChainerMN v1.3, ResNet-50, 10 GbE / FDR step time (plain)",
         "Chainer blog 2018-05-25", "about 3x slower",
         2.5, 3.5, chainermn13_slowdown,
         ("4 x 8 V100, 0.085 s step: assumed",)),
    Case("ChainerMN v1.3, 10 GbE + fp16 + double buffering / FDR step time",
         "Chainer blog 2018-05-25", "within ~11%",
         1.0, 1.15, chainermn13_tuned,
         ("4 x 8 V100, 0.085 s step: assumed", "interference 0.2: assumed")),
)


def validate() -> list[Row]:
  """Every case's prediction next to its published figure and tolerance."""
  return [Row(c.name, c.source, c.published, float(c.predict()), c.low, c.high) for c in CASES]
