"""Alpha-beta time of one allreduce of `nbytes` over a `Cluster`, per algorithm and per mnjax
communicator kind.

Each step of an algorithm sends one message over a `Link`: ``latency + bytes / bandwidth``
(Hockney's alpha-beta model). Ranks are placed in blocks (a node's GPUs are consecutive
ranks), as `mpirun`/`srun` place them by default. When several ranks of a node cross the
network in the same step they share the node's NICs. Reduction arithmetic is left out: on a
GPU it runs at memory speed, hundreds of times faster than any link here.

Sources of the formulas (p ranks, n bytes, alpha latency, beta seconds per byte):

* ring: reduce-scatter then all-gather around a ring, ``2 (p-1) alpha + 2 (p-1)/p n beta``
  (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
  JPDC 2009). Its bandwidth term approaches ``2 n beta``, the lower bound.
* recursive halving/doubling (Rabenseifner's algorithm): ``2 log2(p) alpha + 2 (p-1)/p n
  beta``; for p not a power of two the extra ranks first hand their whole vector to a
  partner and get the result back (Thakur, Rabenseifner, Gropp, "Optimization of Collective
  Communication Operations in MPICH", IJHPCA 2005). MPICH uses it for large messages; its
  first step pairs neighbours (distance 1), so with block placement only the last
  ``log2(nodes)`` steps cross the network, with messages already cut by the GPUs per node.
* hierarchical (ChainerMN's ``hierarchical``, mnjax's ``hierarchical``): allreduce within the
  node, one rank per node allreduces across nodes, hand the result out within the node.
* two-dimensional (ChainerMN's ``two_dimensional``; the "2D-torus" allreduce of Mikami et
  al., arXiv:1811.05233): reduce-scatter within the node, each local rank allreduces its
  ``n/g`` shard across nodes (g flows share the node's NICs), all-gather within the node.
* NCCL's double binary tree (NCCL >= 2.4): a chain through each node's GPUs, a binary tree
  of nodes across the network, pipelined; two complementary trees each carry half the data,
  so every node is inner in one tree and a leaf in the other and sends and receives about
  ``n`` per phase (Sanders, Speck, Träff, "Two-tree algorithms for full bandwidth broadcast,
  reduction and scan", Parallel Computing 2009; NVIDIA blog "Massively Scale Your Deep
  Learning Training with NCCL 2.4", 2019; inter-node trees and intra-node chains:
  NVIDIA/nccl issue #545). NCCL's tuner picks, per call, the algorithm (and protocol) of
  lowest predicted time (NVIDIA/nccl issue #754); `nccl_allreduce` takes ``min(ring, tree)``.

    >>> from lab.costmodel import allreduce, hardware as hw
    >>> c = hw.cluster("mn_1", gpus=1024)
    >>> t = allreduce.kind_time("two_dimensional", 102e6, c)
    >>> round(t * 1e3)      # milliseconds for a ResNet-50-sized fp32 gradient
    32
"""

from __future__ import annotations

import math

from lab.costmodel.hardware import Cluster, Link, log2_floor

ALGORITHMS = ("ring", "halving_doubling", "recursive_doubling")
KINDS = ("flat", "hierarchical", "two_dimensional", "single_node", "xla")


def _hop(nbytes: float, crosses: bool, c: Cluster, sharing: float = 1) -> float:
  link = c.inter if crosses else c.intra
  return link.time(nbytes, sharing if crosses else 1)


def ring(nbytes: float, c: Cluster) -> float:
  """Ring allreduce over every GPU of `c`: ``2 (p-1)`` steps of ``n/p`` bytes, each as slow as
  its slowest hop (a node's last GPU sends across the network, alone on the NIC)."""
  p = c.gpus
  if p == 1:
    return 0.0
  chunk = nbytes / p
  step = _hop(chunk, c.nodes > 1, c)
  if c.gpus_per_node > 1:
    step = max(step, _hop(chunk, False, c))
  return 2 * (p - 1) * step


def halving_doubling(nbytes: float, c: Cluster) -> float:
  """Rabenseifner's recursive halving (reduce-scatter) + doubling (all-gather) over every GPU."""
  p = c.gpus
  if p == 1:
    return 0.0
  p2 = 1 << log2_floor(p)
  g = c.gpus_per_node
  total = 0.0
  for k in range(1, log2_floor(p2) + 1):
    distance = 1 << (k - 1)
    crosses = distance >= g
    # Every rank of a node crosses at once: g flows over the node's NICs.
    sharing = max(1.0, g / c.nics)
    total += 2 * _hop(nbytes / (1 << k), crosses, c, sharing)
  if p != p2:  # the extra ranks' whole vectors, there and back (over the network if any)
    total += 2 * _hop(nbytes, c.nodes > 1, c)
  return total


def recursive_doubling(nbytes: float, c: Cluster) -> float:
  """Recursive doubling: ``log2 p`` exchanges of the whole vector (best for tiny messages)."""
  p = c.gpus
  if p == 1:
    return 0.0
  g = c.gpus_per_node
  steps = math.ceil(math.log2(p))
  return sum(_hop(nbytes, (1 << k) >= g, c, max(1.0, g / c.nics)) for k in range(steps))


def flat_algorithm(name: str):
  if name not in ALGORITHMS:
    raise ValueError(f"unknown allreduce algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
  return {"ring": ring, "halving_doubling": halving_doubling,
          "recursive_doubling": recursive_doubling}[name]


def _node(c: Cluster) -> Cluster:
  return Cluster(c.name, 1, c.gpus_per_node, c.intra, c.inter, c.nics)


def _leaders(c: Cluster) -> Cluster:
  """One rank per node, on one of its NICs."""
  return Cluster(c.name, c.nodes, 1, c.inter, c.inter)


def hierarchical(nbytes: float, c: Cluster, *, inter: str = "halving_doubling",
                 intra_allreduces: float = 2) -> float:
  """Allreduce within each node, across nodes by one rank per node, then within the node again.

  mnjax's ``hierarchical`` kind does two full intra-node allreduces (``psum``, and a ``psum``
  that hands device 0's result out); ChainerMN's reduce + broadcast cost about one
  (``intra_allreduces=1``). One rank per node crosses the network, on one NIC.
  """
  within = ring(nbytes, _node(c))
  across = flat_algorithm(inter)(nbytes, _leaders(c)) if c.nodes > 1 else 0.0
  return intra_allreduces * within + across


def two_dimensional(nbytes: float, c: Cluster, *, inter: str = "halving_doubling") -> float:
  """Reduce-scatter within the node, shard allreduce across nodes, all-gather within the node."""
  g = c.gpus_per_node
  within = ring(nbytes, _node(c))  # reduce-scatter + all-gather = one ring allreduce
  if c.nodes == 1:
    return within
  # g shards of n/g cross at once; they share the node's NICs.
  sharing = max(1.0, g / c.nics)
  shard_link = Link(c.inter.name, c.inter.gbps / sharing, c.inter.efficiency, c.inter.latency)
  shards = Cluster(c.name, c.nodes, 1, shard_link, shard_link)
  return within + flat_algorithm(inter)(nbytes / g, shards)


def _striped(c: Cluster) -> Cluster:
  """`c` with its NICs bonded into one link (NCCL stripes its channels over every NIC)."""
  inter = c.inter.scaled(c.nics) if c.nics > 1 else c.inter
  return Cluster(c.name, c.nodes, c.gpus_per_node, c.intra, inter, 1)


def double_binary_tree(nbytes: float, c: Cluster) -> float:
  """NCCL's tree allreduce: intra-node chains, a pipelined double binary tree of nodes.

  A chunk climbs the node's chain (``g-1`` NVLink/PCIe hops) and the tree of nodes
  (``ceil(log2 N)`` network hops), then comes back down: the latency term is
  ``2 (g-1) alpha_intra + 2 ceil(log2 N) alpha_inter``, logarithmic in the nodes where the
  ring's is linear in the GPUs. Each byte is sent once up (reduce) and once down
  (broadcast): every GPU sends ``2n`` over its intra-node link and, the two trees splitting
  the data, every node ``2n`` over all of its NICs. Reduce and broadcast are pipelined
  through both, so the slower one sets the bandwidth term. Pipeline fill (chunk size) and
  NCCL's protocols (LL, LL128, Simple) are left out.

  Args:
    nbytes: bytes each GPU contributes (and receives back).
    c: the cluster; every GPU takes part.

  Returns:
    Seconds, ``latency + 2 n / min(B_intra, nics B_inter)``.

  >>> from lab.costmodel import allreduce, hardware as hw
  >>> c = hw.cluster("h200_ndr", gpus=1024)
  >>> round(allreduce.double_binary_tree(4, c) * 1e6)    # microseconds: 14 x 3 + 14 x 1
  56
  """
  if c.gpus == 1:
    return 0.0
  g, nodes = c.gpus_per_node, c.nodes
  latency = 2 * (g - 1) * c.intra.latency
  rates = [c.intra.bandwidth] if g > 1 else []
  if nodes > 1:
    latency += 2 * math.ceil(math.log2(nodes)) * c.inter.latency
    rates.append(c.inter.bandwidth * c.nics)
  return latency + 2 * nbytes / min(rates)


NCCL_ALGORITHMS = ("auto", "ring", "tree")


def nccl_allreduce(nbytes: float, c: Cluster, algorithm: str = "auto") -> float:
  """NCCL's allreduce over every GPU of `c`, channels striped over every NIC of a node.

  Args:
    nbytes: bytes each GPU contributes.
    c: the cluster.
    algorithm: ``"ring"`` (`ring`, NCCL < 2.4 or ``NCCL_ALGO=Ring``), ``"tree"``
      (`double_binary_tree`) or ``"auto"``: the faster of the two, as NCCL's tuner picks.

  Returns:
    Seconds.

  >>> from lab.costmodel import allreduce, hardware as hw
  >>> c = hw.cluster("h200_ndr", gpus=1024)
  >>> [round(allreduce.nccl_allreduce(4, c, a) * 1e6) for a in ("ring", "tree", "auto")]
  [6138, 56, 56]
  """
  if algorithm not in NCCL_ALGORITHMS:
    raise ValueError(f"unknown NCCL algorithm {algorithm!r}; choose from "
                     f"{', '.join(NCCL_ALGORITHMS)}")
  striped = _striped(c)
  if algorithm == "ring":
    return ring(nbytes, striped)
  if algorithm == "tree":
    return double_binary_tree(nbytes, c)
  return min(ring(nbytes, striped), double_binary_tree(nbytes, c))


def kind_time(kind, nbytes: float, c: Cluster, *, flat: str = "halving_doubling",
              nccl: str = "auto") -> float:
  """Seconds for one allreduce of `nbytes` with mnjax communicator `kind` on GPUs of `c`.

  Args:
    kind: ``flat``: one MPI process per GPU, MPI_Allreduce. ``hierarchical``,
      ``two_dimensional``: those functions. ``xla``: NCCL over all GPUs, striped over every
      NIC of a node (see `nccl_allreduce`). ``single_node``: one node only. Or a callable
      ``(nbytes, cluster) -> seconds``.
    nbytes: bytes each GPU contributes.
    c: the cluster.
    flat: the MPI algorithm of ``flat`` (MPICH's large-message choice by default).
    nccl: NCCL's algorithm for ``xla``: ``"auto"`` (min of ring and tree), ``"ring"``
      or ``"tree"``.

  Returns:
    Seconds.

  >>> from lab.costmodel import allreduce, hardware as hw
  >>> c = hw.cluster("h200_ndr", gpus=1024)
  >>> [round(allreduce.kind_time("xla", 102e6, c, nccl=a) * 1e3, 2) for a in ("ring", "auto")]
  [6.7, 0.62]
  """
  if callable(kind):  # a custom algorithm: (nbytes, cluster) -> seconds
    return kind(nbytes, c)
  if kind == "flat":
    return flat_algorithm(flat)(nbytes, c)
  if kind == "hierarchical":
    return hierarchical(nbytes, c)
  if kind == "two_dimensional":
    return two_dimensional(nbytes, c)
  if kind == "single_node":
    if c.nodes > 1:
      raise ValueError(f"single_node spans one node; {c.name} has {c.nodes}")
    return ring(nbytes, c)
  if kind == "xla":
    return nccl_allreduce(nbytes, c, nccl)
  raise ValueError(f"unknown communicator kind {kind!r}; kinds: {', '.join(KINDS)}")


def bus_bandwidth(nbytes: float, seconds: float, ranks: int) -> float:
  """NCCL's bus bandwidth: ``2 (p-1)/p n / t`` (the link rate a ring would need)."""
  return 2 * (ranks - 1) / ranks * nbytes / seconds


def ring_bandwidth_term(nbytes: float, p: int, link: Link) -> float:
  """The bandwidth term alone, ``2 (p-1)/p n / B``: what `ring` approaches for large n."""
  return 2 * (p - 1) / p * nbytes / link.bandwidth
