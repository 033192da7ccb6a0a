"""Links and clusters: the hardware side of the cost model, with the figures' sources.

A `Link` is one direction of one connection as an MPI/NCCL transfer sees it: a line rate,
the fraction of it a large transfer achieves, and a per-message latency. A `Cluster` is
nodes of GPUs: one intra-node link per GPU and ``nics`` inter-node links per node.

    >>> from lab.costmodel import hardware as hw
    >>> hw.IB_FDR.bandwidth / 1e9          # bytes/s achieved by one FDR 4x link
    6.1...
    >>> c = hw.cluster("h200_ndr", gpus=1024)
    >>> c.nodes, c.gpus_per_node
    (128, 8)
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Link:
  """One direction of a link: ``gbps`` line data rate (Gbit/s), ``efficiency`` the fraction of
  it that a large transfer achieves, ``latency`` seconds per message (software included)."""

  name: str
  gbps: float
  efficiency: float
  latency: float

  def __post_init__(self):
    if not (self.gbps > 0 and 0 < self.efficiency <= 1 and self.latency >= 0):
      raise ValueError(f"Link {self.name!r}: need gbps > 0, 0 < efficiency <= 1 and "
                       f"latency >= 0; got {self.gbps}, {self.efficiency}, {self.latency}")

  @property
  def bandwidth(self) -> float:
    """Bytes per second a large transfer achieves."""
    return self.gbps * 1e9 / 8 * self.efficiency

  def time(self, nbytes: float, sharing: float = 1) -> float:
    """Seconds to send one message of `nbytes` while `sharing` flows split the link."""
    return self.latency + nbytes * sharing / self.bandwidth

  def scaled(self, links: int) -> Link:
    """`links` of these bonded (multi-rail): the bandwidth adds up, the latency does not."""
    return dataclasses.replace(self, name=f"{links}x {self.name}", gbps=self.gbps * links)


# InfiniBand 4x: data rates after encoding (FDR/EDR and later use 64b/66b). Efficiency 0.9:
# MPI point-to-point bandwidth (OSU osu_bw) reaches ~6.0-6.2 GB/s on FDR ConnectX-3 and ~90%
# of the data rate on later generations (Mellanox/NVIDIA adapter datasheets).
IB_FDR = Link("InfiniBand FDR 4x", 54.5, 0.9, 1.5e-6)
IB_EDR = Link("InfiniBand EDR 4x", 100, 0.9, 1.2e-6)
IB_HDR = Link("InfiniBand HDR 4x", 200, 0.9, 1.1e-6)
IB_NDR = Link("InfiniBand NDR 4x", 400, 0.9, 1.0e-6)
# Ethernet through the kernel's TCP/IP stack (no RDMA), as MPI, Gloo and NCCL's socket
# transport of 2017-2018 used it: one TCP stream per peer, ~60% of the line rate for large
# transfers (assumption, the one figure all three TCP validation cases share:
# lab.costmodel.published) and tens of microseconds per message.
ETH_10G = Link("10 GbE (TCP)", 10, 0.6, 30e-6)
ETH_25G = Link("25 GbE (TCP)", 25, 0.6, 25e-6)
ETH_50G = Link("50 GbE (TCP)", 50, 0.6, 20e-6)
ETH_100G = Link("100 GbE (TCP)", 100, 0.6, 15e-6)
# The same Ethernet with RDMA (RoCE v2): as efficient as InfiniBand.
ROCE_100G = Link("100 GbE (RoCE)", 100, 0.9, 2e-6)
# NVLink: aggregate per GPU and direction (links x per-link rate, NVIDIA's architecture
# whitepapers): P100 4 x 20 GB/s, V100 6 x 25, A100 12 x 25, H100/H200 18 x 25, B200 18 x 50.
# NCCL's all-reduce bus bandwidth reaches ~80% of it (nccl-tests on DGX systems).
NVLINK1 = Link("NVLink 1 (P100)", 640, 0.8, 5e-6)
NVLINK2 = Link("NVLink 2 (V100)", 1200, 0.8, 5e-6)
NVLINK3 = Link("NVLink 3 (A100)", 2400, 0.8, 4e-6)
NVLINK4 = Link("NVLink 4 (H100/H200)", 3600, 0.8, 3e-6)
NVLINK5 = Link("NVLink 5 (B200)", 7200, 0.8, 3e-6)
# PCIe x16 (128b/130b): gen3 15.75 GB/s, gen4 31.5, gen5 63; ~75% achieved by device copies
# and NCCL over PCIe.
PCIE3 = Link("PCIe 3.0 x16", 126, 0.75, 8e-6)
PCIE4 = Link("PCIe 4.0 x16", 252, 0.75, 6e-6)
PCIE5 = Link("PCIe 5.0 x16", 504, 0.75, 5e-6)

LINKS = {link.name: link for link in (
    IB_FDR, IB_EDR, IB_HDR, IB_NDR, ETH_10G, ETH_25G, ETH_50G, ETH_100G, ROCE_100G,
    NVLINK1, NVLINK2, NVLINK3, NVLINK4, NVLINK5, PCIE3, PCIE4, PCIE5)}


@dataclasses.dataclass(frozen=True)
class Cluster:
  """``nodes`` x ``gpus_per_node`` GPUs; `intra` joins a node's GPUs (per GPU), `inter` is one
  of the ``nics`` network links of each node."""

  name: str
  nodes: int
  gpus_per_node: int
  intra: Link
  inter: Link
  nics: int = 1

  def __post_init__(self):
    if self.nodes < 1 or self.gpus_per_node < 1 or self.nics < 1:
      raise ValueError(f"Cluster {self.name!r}: nodes, gpus_per_node and nics must be >= 1; "
                       f"got {self.nodes}, {self.gpus_per_node}, {self.nics}")

  @property
  def gpus(self) -> int:
    return self.nodes * self.gpus_per_node

  def with_gpus(self, gpus: int) -> Cluster:
    """The same kind of node, as many as `gpus` needs (a partial node when fewer GPUs)."""
    if gpus < 1:
      raise ValueError(f"gpus must be >= 1, got {gpus}")
    if gpus <= self.gpus_per_node:
      return dataclasses.replace(self, nodes=1, gpus_per_node=gpus)
    if gpus % self.gpus_per_node:
      raise ValueError(f"{gpus} GPUs do not fill whole nodes of {self.gpus_per_node} "
                       f"({self.name}); use a multiple of {self.gpus_per_node}")
    return dataclasses.replace(self, nodes=gpus // self.gpus_per_node)


# Presets. Sources:
# - chainermn_2017: Akiba, Fukuda, Suzuki, "ChainerMN: Scalable Distributed Deep Learning
#   Framework", LearningSys 2017 (arXiv:1710.11351): 32 nodes x 4 GeForce GTX TITAN X
#   (Maxwell) on PCIe, InfiniBand FDR 4x.
# - mn_1: Preferred Networks' MN-1 (PFN blog "MN-1: A GPU cluster behind 15-min ImageNet",
#   2017): 128 nodes x 8 P100 (PCIe), two FDR links per node.
# - big_basin_50gbe: Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1
#   Hour" (arXiv:1706.02677) section 5: Big Basin servers, 8 P100 joined by NVLink, one
#   50 Gbit Ethernet card (Mellanox ConnectX-4) per server.
# - horovod_25gbe: Sergeev, Del Balso, "Horovod: fast and easy distributed deep learning in
#   TensorFlow" (arXiv:1802.05799): 128 Pascal GPUs, 4 per server, 25 Gbit/s TCP network.
# - h200_ndr: a current DGX-H200-like node: 8 H200 on NVLink 4 (NVSwitch), one 400 Gb/s NDR
#   adapter per GPU (8 per node).
PRESETS = {
    "chainermn_2017": Cluster("ChainerMN 2017 (4x TITAN X, FDR)", 32, 4, PCIE3, IB_FDR),
    "mn_1": Cluster("MN-1 (8x P100, 2x FDR)", 128, 8, PCIE3, IB_FDR, nics=2),
    "big_basin_50gbe": Cluster("Big Basin (8x P100 NVLink, 50 GbE)", 32, 8, NVLINK1, ETH_50G),
    "horovod_25gbe": Cluster("Uber 2017 (4x P100, 25 GbE)", 32, 4, PCIE3, ETH_25G),
    "h200_ndr": Cluster("H200 + NDR (8x H200, 8x NDR)", 128, 8, NVLINK4, IB_NDR, nics=8),
    # The same nodes on one 10 GbE (TCP) per node: a slow link, as across sites or clouds.
    "h200_10gbe": Cluster("H200 + 10 GbE (8x H200, one 10 GbE)", 128, 8, NVLINK4, ETH_10G),
}


def cluster(name: str, gpus: int | None = None) -> Cluster:
  """A preset by name (`PRESETS`), optionally resized to `gpus` GPUs of the same nodes."""
  if name not in PRESETS:
    raise ValueError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)}")
  c = PRESETS[name]
  return c if gpus is None else c.with_gpus(gpus)


def log2_floor(p: int) -> int:
  return int(math.floor(math.log2(p)))
