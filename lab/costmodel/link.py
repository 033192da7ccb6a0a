"""The cost model on an emulated link (``lab.cluster``): the bytes each node's uplink carries
per gradient exchange, and alpha and beta fitted once from the link.

Bytes per node and direction, `n` gradient bytes in float32, `N` nodes, `g` MPI ranks per
node (block placement), a 16-bit wire moving `n/2`:

* ``flat`` (MPICH's recursive halving/doubling, or its node-aware composition: the same
  bytes), ``hierarchical`` (one rank per node crosses) and ``two_dimensional`` (`g` shards of
  ``n/g``): ``2 n (1 - 1/N)`` each. Recursive halving with ranks placed in blocks crosses the
  network only in its last ``log2 N`` steps, with messages already cut by `g`: in bytes it is
  node-aware already, so ``hierarchical`` wins on latency and flows, not on bytes.
* a 16-bit wire with one rank per node: an alltoall then an allgather of ``n/2``, each
  ``(N-1)/N n/2``: half of float32's.
* ``xla`` on CPUs (gloo): one ring over all ``P = N g`` participants, `g` devices per node
  (processes x devices; gloo counts each device): a reduce-scatter and an allgather around
  the ring, ``2 n (P-1)/P`` per participant; placed in blocks, one ring edge per node
  crosses its uplink: ``2 n (1 - 1/(N g))``, 1.5 n at 2 x 2 where the MPI kinds send n.
* ``shard_optimizer`` (ZeRO-1, float32, ``flat``): a reduce-scatter of the gradients and
  an allgather of the updated parameters. MPICH's large-message algorithms are not
  node-aware: the reduce-scatter is a pairwise exchange (each rank sends ``n/P`` to every
  other, ``g n (N-1)/N`` per node) and the allgather a ring (one edge per node carries
  ``n (P-1)/P``). With one rank per node that is an allreduce's ``2 n (1 - 1/N)``; at 2 x 2
  it is 1.75 n where the allreduce sends n.

    >>> from lab.costmodel import link
    >>> link.uplink_bytes("flat", 4e6, nodes=2)
    4000000.0
    >>> link.uplink_bytes("hierarchical", 4e6, nodes=2, wire_bits=16)
    2000000.0
"""

from __future__ import annotations

import dataclasses

import numpy as np

_KINDS = ("flat", "hierarchical", "two_dimensional", "xla", "shard_optimizer")


def uplink_bytes(kind: str, nbytes: float, *, nodes: int, ranks_per_node: int = 1,
                 wire_bits: int = 32) -> float:
  """Payload bytes one node's uplink sends (and receives) per allreduce of `nbytes` (float32).

  For ``xla``, `ranks_per_node` counts gloo's participants on a node: processes x devices.
  """
  if kind not in _KINDS:
    raise ValueError(f"uplink_bytes knows {', '.join(_KINDS)}; got {kind!r}")
  if wire_bits not in (16, 32):
    raise ValueError(f"wire_bits must be 16 or 32, got {wire_bits}")
  if nodes < 1 or ranks_per_node < 1:
    raise ValueError(f"nodes and ranks_per_node must be >= 1, got {nodes}, {ranks_per_node}")
  if kind == "xla":   # gloo's ring over every device; ranks_per_node: devices per node
    if wire_bits != 32:
      raise ValueError("the xla kind's bytes are modelled for a float32 wire")
    return 2 * nbytes * (1 - 1 / (nodes * ranks_per_node))
  if kind == "shard_optimizer":   # pairwise reduce-scatter + ring allgather (MPICH)
    if wire_bits != 32:
      raise ValueError("shard_optimizer's bytes are modelled for a float32 wire")
    ranks = nodes * ranks_per_node
    return nbytes * (ranks_per_node * (1 - 1 / nodes) + (1 - 1 / ranks))
  if wire_bits == 32:
    return 2 * nbytes * (1 - 1 / nodes)
  # Node-aware: float32 within the node, the node's buffer once in 16 bits across (flat with
  # several ranks per node: each rank its 1/k shard), whatever the ranks per node.
  return nbytes * (1 - 1 / nodes)


@dataclasses.dataclass(frozen=True)
class LinkFit:
  """``t = alpha + max(0, bytes_per_node - burst) / bandwidth`` for one exchange over the
  emulated uplinks.

  `alpha_first`: the latency of a step's first exchange, after the link and the ranks'
  progress threads idled through the step's compute (None: `alpha`); `alpha` is then what
  each exchange that follows another back to back pays.

  `burst`: bytes a shaper with a full token bucket lets through at once (tc's ``tbf``
  ``burst``, `lab.cluster.burst_bytes`: 250 kB at 1 Gbit/s). The bucket refills at the
  shaper's rate, `refill` bytes/s, while the link is idle: an exchange after ``idle_s`` of
  compute gets ``min(burst, idle_s * refill)`` (`available_burst`), once per step; back to
  back exchanges get little of it. `refill` 0: the whole burst whatever the idle time. 0 for
  a link that is not shaped.
  """

  alpha: float
  bandwidth: float
  burst: float = 0.0
  refill: float = 0.0
  alpha_first: float | None = None

  def available_burst(self, idle_s: float | None = None) -> float:
    """Bytes of the burst an exchange gets after the link was idle `idle_s` (None: long).

    >>> f = LinkFit(1e-3, 1e8, burst=2.5e5, refill=1.25e8)   # 1 Gbit/s
    >>> f.available_burst(), f.available_burst(1e-3), f.available_burst(0.01)
    (250000.0, 125000.0, 250000.0)
    """
    if idle_s is None or not self.refill:
      return self.burst
    return min(self.burst, max(idle_s, 0.0) * self.refill)

  def exchange_time(self, kind: str, nbytes: float, *, nodes: int, ranks_per_node: int = 1,
                    wire_bits: int = 32, idle_s: float | None = None) -> float:
    """Predicted seconds of one gradient exchange, after `idle_s` of idle link.

    >>> LinkFit(1e-3, 1e8).exchange_time("flat", 1e8, nodes=2)
    1.001
    >>> LinkFit(1e-3, 1e8, burst=2.5e5).exchange_time("flat", 2e5, nodes=2)   # within it
    0.001
    """
    return self.buckets_time(kind, [nbytes], nodes=nodes, ranks_per_node=ranks_per_node,
                             wire_bits=wire_bits, idle_s=idle_s)

  def buckets_time(self, kind: str, buckets: list[float], *, nodes: int,
                   ranks_per_node: int = 1, wire_bits: int = 32,
                   in_flight: bool = False, idle_s: float | None = None) -> float:
    """Predicted seconds of a step's exchange of `buckets` (float32 bytes each), the link
    idle for `idle_s` before it (the step's compute; None: long enough to refill the burst).

    The first bucket pays ``alpha_first``; one after the other, every later bucket pays
    ``alpha``; `in_flight` (``flat`` without a 16-bit wire: each bucket starts as soon as
    the previous one has started), the buckets share the link and pay the first's latency
    only. The burst counts once per step (`available_burst`).

    >>> f = LinkFit(1e-3, 1e8)
    >>> [round(f.buckets_time("flat", [1e6, 1e6], nodes=2, in_flight=i), 3) for i in (0, 1)]
    [0.022, 0.021]
    >>> g = LinkFit(1e-3, 1e8, alpha_first=3e-3)
    >>> [round(g.buckets_time("flat", [1e6, 1e6], nodes=2, in_flight=i), 3) for i in (0, 1)]
    [0.024, 0.023]
    """
    if not buckets:
      return 0.0
    first = self.alpha if self.alpha_first is None else self.alpha_first
    if nodes == 1:
      return first
    sent = sum(uplink_bytes(kind, b, nodes=nodes, ranks_per_node=ranks_per_node,
                            wire_bits=wire_bits) for b in buckets)
    later = 0 if in_flight else len(buckets) - 1
    beyond = max(0.0, sent - self.available_burst(idle_s))
    return first + later * self.alpha + beyond / self.bandwidth


def fit(bytes_per_node, seconds, *, relative: bool = False, burst: float = 0.0,
        refill: float = 0.0, idle_s=None, first=None) -> LinkFit:
  """Least-squares alpha and bandwidth from (uplink bytes per exchange, seconds) points.

  `relative`: minimise relative, not absolute, errors (each point weighted by 1/seconds), so
  that points of 64 kB count as much as those of 16 MB: alpha is then set by the small
  messages, as a step's small buckets need it. `burst` and `refill`: the shaper's
  (`LinkFit`), known from its configuration, with `idle_s` the link's idle time before each
  point (None: long): the bytes beyond the burst each point got are what the bandwidth moves.
  `first` (one bool per point): the points that are a step's first exchange after idle
  (they give `alpha_first`; the others, exchanges back to back, `alpha`; one bandwidth).
  A back-to-back point that got part of the burst (more bytes than refilled, fewer than the
  whole burst beyond that) is left out there: how much of the burst it had is the least
  certain, and it would move the bandwidth; the points after idle had all of it.

  >>> f = fit([1e6, 1e7, 1e8], [0.011, 0.02, 0.11])
  >>> round(f.alpha, 3), round(f.bandwidth / 1e9, 2)
  (0.01, 1.0)
  >>> b, t = [1e5, 1e6, 1e7, 1e8], [0.002, 0.011, 0.10, 1.2]   # 1 ms + 100 MB/s, 100 MB slow
  >>> [round(fit(b, t, relative=r).alpha * 1e3, 2) for r in (False, True)]   # ms
  [0.0, 0.93]
  >>> g = fit([1e5, 1e6, 1e7], [0.001, 0.010, 0.100], burst=1e5)   # 100 MB/s after 100 kB
  >>> round(g.alpha * 1e3, 2), round(g.bandwidth / 1e6), g.burst
  (1.0, 100, 100000.0)
  >>> h = fit([1e5, 1e6, 1e7], [0.0015, 0.0105, 0.1005], burst=1e5, refill=1e8,
  ...         idle_s=[5e-4] * 3)   # back to back: 50 kB of the burst refilled
  >>> round(h.alpha * 1e3, 2), round(h.bandwidth / 1e6)
  (1.0, 100)
  >>> k = fit([1e5, 1e6, 1e5, 1e6], [0.0010, 0.0100, 0.0015, 0.0105],   # +0.5 ms after idle
  ...         first=[False, False, True, True])
  >>> round(k.alpha * 1e3, 2), round(k.alpha_first * 1e3, 2), round(k.bandwidth / 1e6)
  (0.0, 0.5, 100)
  """
  b = np.asarray(bytes_per_node, float)
  t = np.asarray(seconds, float)
  if b.shape != t.shape or b.size < 2 or np.any(t <= 0):
    raise ValueError(f"need two or more (bytes, seconds > 0) points; got {b.size}, {t.size}")
  shaper = LinkFit(0.0, 1.0, float(burst), float(refill))
  idle = [None] * b.size if idle_s is None else list(idle_s)
  beyond = np.maximum(b - np.asarray([shaper.available_burst(i) for i in idle]), 0.0)
  if np.count_nonzero(beyond) < 1 or np.unique(beyond).size < 2:
    raise ValueError(f"need points of two sizes, one beyond the burst ({burst:.0f} bytes)")
  w = 1 / t if relative else np.ones_like(t)
  if first is None:
    slope, alpha = np.polyfit(beyond, t, 1, w=w)
    alpha_first = None
  else:
    f = np.asarray(first, bool)
    if f.shape != t.shape or f.all() or not f.any():
      raise ValueError("first: one bool per point, some True and some False")
    keep = f | ~((beyond > 0) & (beyond < float(burst)))
    columns = np.stack([~f, f, beyond], axis=1).astype(float)[keep]
    (alpha, alpha_first, slope), *_ = np.linalg.lstsq(columns * w[keep, None], (t * w)[keep],
                                                      rcond=None)
    alpha_first = max(float(alpha_first), 0.0)
  if slope <= 0:
    raise ValueError("the exchange time does not grow with the bytes: the link is not the "
                     "bottleneck (fewer ranks, a lower rate, or larger messages)")
  return LinkFit(max(float(alpha), 0.0), 1 / float(slope), float(burst), float(refill),
                 alpha_first)
