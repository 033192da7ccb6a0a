"""Step time and parallel efficiency of data-parallel training from the allreduce model.

A step computes (forward + backward + update, `Workload.compute` seconds at a fixed batch per
GPU: weak scaling) and allreduces the gradient in buckets. How much of the communication
shows in the step depends on `overlap`:

* ``"none"``: after the backward pass (ChainerMN 2017; mnjax on the MPI kinds with
  `mnjax.SyncBatchNorm`, whose last backward collective comes first):
  ``compute + comm``;
* ``"backward"``: each bucket starts as soon as the backward pass has produced it (Horovod,
  PyTorch DDP, Goyal et al.; mnjax's buckets on GPUs without SyncBatchNorm, which leave
  in backprop order with no barrier: tests/unit/test_primitives.py): buckets become ready
  evenly over the backward pass and go out one after another; what is left after the
  backward pass shows;
* ``"double_buffering"``: step t's gradient travels during step t+1 and the optimizer
  applies it one step late (ChainerMN v1.2+; ``create_multi_node_optimizer(tx, comm,
  double_buffering=True)``): ``max(compute + interference x hidden, comm)``. In mnjax the
  exchange then reads only the optimizer state (tests/unit/test_overlap.py), except with
  `mnjax.SyncBatchNorm` on the MPI kinds, where it starts after the layer's last backward
  collective, near the end of the backward pass: model that case as ``"none"``.

Local SGD and DiLoCo (``step_time(..., sync_every=k)``, `mnjax.optim.local_sgd(tx, comm,
every_k=k)`): each rank steps on its own gradient and the ranks exchange their parameters
(as many bytes as the gradient) once every `k` steps, after the update: the exchange is
``overlap="none"``'s, paid once per `k` steps (``comm / k`` per step, on average).

ZeRO-1 (``step_time(..., shard_optimizer=True)``, `mnjax.shard_optimizer`): the gradient is
reduce-scattered and the updates all-gathered, the same bytes per rank as the allreduce
(one allreduce is a reduce-scatter then an all-gather), so ``comm`` is unchanged (one rank
per node; with several, MPI's reduce-scatter is not node-aware and a node's uplink carries
more: ``lab.costmodel.link.uplink_bytes``); each GPU
runs the optimizer update (`Workload.update` seconds of `Workload.compute`) on 1/P of the
parameters and holds 1/P of its state (`optimizer_state_bytes`). The all-gather follows the
update, so only ``overlap="none"`` is modelled for it.

`planned_buckets` gives the bucket sizes mnjax's own plan cuts a model's gradient into
(`mnjax.comm._instep._buckets.tree_buckets`); pass them as ``bucket_sizes`` to tie the model to
the implementation instead of equal buckets.

Overlapped communication is not free: it competes with the computation for memory
bandwidth, PCIe, SMs and host CPU. ``interference`` is the fraction of the overlapped
communication time that still adds to the step (0: perfect overlap).

Parallel efficiency is weak-scaling efficiency: the step time of one GPU alone (no
communication at all) over the step time on p GPUs, or against a reference GPU count.

    >>> from lab.costmodel import hardware as hw, step
    >>> w = step.RESNET50
    >>> c = hw.cluster("h200_ndr", gpus=1024)
    >>> round(step.efficiency(w.replace(compute=0.1), c, "two_dimensional"), 3)
    0.989
"""

from __future__ import annotations

import dataclasses

from lab.costmodel.allreduce import kind_time
from lab.costmodel.hardware import Cluster

OVERLAPS = ("none", "backward", "double_buffering")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model's gradient (`params` elements) and one GPU's step time without communication
  (`compute` seconds, of which `update` is the optimizer update: what ZeRO-1 divides by P)."""

  name: str
  params: int
  compute: float
  batch_per_gpu: int = 32
  backward_share: float = 2 / 3  # backward ~ 2x forward: the usual FLOP count for convnets
  update: float = 0.0

  def __post_init__(self):
    if self.params < 1 or self.compute <= 0 or not 0 < self.backward_share <= 1:
      raise ValueError(f"Workload {self.name!r}: need params >= 1, compute > 0 and "
                       f"0 < backward_share <= 1; got {self.params}, {self.compute}, "
                       f"{self.backward_share}")
    if not 0 <= self.update <= self.compute:
      raise ValueError(f"Workload {self.name!r}: the optimizer update is part of the step,"
                       f" need 0 <= update <= compute; got update={self.update},"
                       f" compute={self.compute}")

  def replace(self, **changes) -> Workload:
    return dataclasses.replace(self, **changes)


# Parameter counts: torchvision/flax ResNet-50 and ResNet-101 (ImageNet, 1000 classes).
# Compute times are placeholders here; published cases set their own (lab.costmodel.published).
RESNET50 = Workload("ResNet-50", 25_557_032, compute=0.25)
RESNET101 = Workload("ResNet-101", 44_549_160, compute=0.5)


@dataclasses.dataclass(frozen=True)
class Software:
  """What the implementation adds to the links: ``per_call`` seconds per allreduce call
  (launch, synchronization) and the packing of leaves into buckets and back, two passes over
  the gradient at ``pack_bandwidth`` bytes/s (None: free)."""

  per_call: float = 0.0
  pack_bandwidth: float | None = None

  def pack_time(self, nbytes: float) -> float:
    return 0.0 if self.pack_bandwidth is None else 2 * nbytes / self.pack_bandwidth


@dataclasses.dataclass(frozen=True)
class StepTime:
  compute: float     # the GPU's own work
  comm: float        # every allreduce call of the step, back to back
  exposed: float     # what the step waits for beyond `compute`

  @property
  def total(self) -> float:
    return self.compute + self.exposed


def buckets(nbytes: float, bucket_bytes: float | None) -> list[float]:
  """Sizes of the buckets a gradient of `nbytes` travels in (one when `bucket_bytes` is None)."""
  if bucket_bytes is None or bucket_bytes >= nbytes:
    return [nbytes]
  full, rest = divmod(nbytes, bucket_bytes)
  return [float(bucket_bytes)] * int(full) + ([rest] if rest else [])


def planned_buckets(grads, bucket_bytes: int | None, *, wire_dtype=None) -> list[float]:
  """Wire bytes of each bucket, in the order mnjax sends them, for a gradient tree `grads`
  (leaves: arrays or ``jax.ShapeDtypeStruct``s): `mnjax.comm._instep._buckets.tree_buckets`,
  the plan `allreduce_gradients` uses.

  >>> import jax, jax.numpy as jnp
  >>> leaves = [jax.ShapeDtypeStruct((1024,), jnp.float32)] * 3
  >>> planned_buckets(leaves, 8192)
  [8192.0, 4096.0]
  """
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from mnjax.comm._instep._allreduce import tree_buckets  # noqa: PLC0415 the layer below, lazily

  wire = None if wire_dtype is None else np.dtype(wire_dtype)
  order, plan = tree_buckets(grads, wire_dtype=wire, bucket_bytes=bucket_bytes)
  leaves = jax.tree.leaves(grads)
  return [float(sum(leaves[order[i]].size for i in b.positions) * (wire or b.dtype).itemsize)
          for b in plan]


def step_time(w: Workload, c: Cluster, kind: str, *, wire_bytes: int = 4,
              bucket_bytes: float | None = None, overlap: str = "none",
              interference: float = 0.0, software: Software = Software(),
              flat: str = "halving_doubling", nccl: str = "auto",
              bucket_sizes: list[float] | None = None,
              shard_optimizer: bool = False, sync_every: int = 1) -> StepTime:
  """The modelled step of `w` on every GPU of `c` with communicator `kind`.

  `wire_bytes`: bytes per gradient element on the wire (4: float32, 2: bf16/fp16 wire).
  `flat`, `nccl`: the algorithms of kinds ``flat`` and ``xla`` (`allreduce.kind_time`).
  `bucket_sizes`: the buckets' wire bytes in send order (`planned_buckets`), instead of
  cutting ``w.params * wire_bytes`` into equal `bucket_bytes`.
  `shard_optimizer`: the ZeRO-1 step (module docstring): the same ``comm``, ``w.update``
  divided by the GPU count; ``overlap="none"`` only.
  `sync_every`: local SGD's ``every_k`` (module docstring): the exchange once per that many
  steps, averaged per step; ``overlap="none"`` only.

  >>> from lab.costmodel import hardware as hw
  >>> w = RESNET50.replace(compute=0.1, update=0.02)
  >>> c = hw.cluster("h200_ndr", gpus=8)
  >>> zero, plain = (step_time(w, c, "flat", shard_optimizer=s) for s in (True, False))
  >>> round(zero.compute, 4), zero.comm == plain.comm
  (0.0825, True)
  >>> local = step_time(w, c, "flat", sync_every=8)
  >>> round(local.comm * 8 / plain.comm, 6), local.exposed == local.comm
  (1.0, True)
  """
  if overlap not in OVERLAPS:
    raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
  if wire_bytes not in (1, 2, 4, 8):
    raise ValueError(f"wire_bytes must be 1, 2, 4 or 8, got {wire_bytes!r}")
  if not 0 <= interference <= 1:
    raise ValueError(f"interference must be in [0, 1], got {interference!r}")
  if shard_optimizer and overlap != "none":
    raise ValueError(f"shard_optimizer=True is modelled with overlap='none' only (the"
                     f" all-gather follows the update), got overlap={overlap!r}")
  if not isinstance(sync_every, int) or sync_every < 1:
    raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
  if sync_every > 1 and overlap != "none":
    raise ValueError(f"sync_every={sync_every} (local SGD) is modelled with overlap='none' only"
                     f" (the parameters travel after the update), got overlap={overlap!r}")
  if c.gpus == 1:
    return StepTime(w.compute, 0.0, 0.0)
  if shard_optimizer:  # each GPU updates 1/P of the parameters
    w = w.replace(compute=(w.compute - w.update) + w.update / c.gpus, update=w.update / c.gpus)
  nbytes = w.params * wire_bytes if bucket_sizes is None else float(sum(bucket_sizes))
  sizes = buckets(nbytes, bucket_bytes) if bucket_sizes is None else list(bucket_sizes)
  times = [kind_time(kind, b, c, flat=flat, nccl=nccl) + software.per_call
           + software.pack_time(b) for b in sizes]
  comm = sum(times) / sync_every
  if overlap == "none":
    return StepTime(w.compute, comm, comm)
  if overlap == "double_buffering":
    hidden = min(comm, w.compute)
    total = max(w.compute + interference * hidden, comm)
    return StepTime(w.compute, comm, total - w.compute)
  backward = w.compute * w.backward_share
  start_backward = w.compute - backward  # the update's share is small; folded into forward
  done, clock = 0.0, 0.0
  for size, t in zip(sizes, times):
    done += size
    ready = start_backward + backward * done / nbytes
    clock = max(clock, ready) + t
  hidden = comm - max(0.0, clock - w.compute)
  return StepTime(w.compute, comm, max(0.0, clock - w.compute) + interference * hidden)


def optimizer_state_bytes(w: Workload, gpus: int, *, bytes_per_param: float = 8,
                          shard_optimizer: bool = False) -> float:
  """Bytes of optimizer state on each GPU: ``w.params * bytes_per_param`` (adam: two float32
  moments, 8), divided by `gpus` with ZeRO-1 (`shard_optimizer`).

  >>> optimizer_state_bytes(RESNET50, 4, shard_optimizer=True) / 1e6   # MB
  51.114064
  """
  if gpus < 1 or not bytes_per_param >= 0:
    raise ValueError(f"need gpus >= 1 and bytes_per_param >= 0; got {gpus}, {bytes_per_param}")
  return w.params * bytes_per_param / (gpus if shard_optimizer else 1)


BUCKET_CANDIDATES = (1 << 20, 4 << 20, 16 << 20, 25 << 20, 64 << 20, None)


def best_bucket_bytes(w: Workload, c: Cluster, kind: str,
                      candidates=BUCKET_CANDIDATES, **options) -> float | None:
  """The gradient bucket size of lowest modelled step time, overlapped with the backward pass.

  Smaller buckets start earlier and leave less after the backward pass; each costs one more
  call (latency and ``software.per_call``). Candidates: PyTorch DDP's 25 MB default,
  Horovod's 64 MB fusion buffer, mnjax's 4 MB, and ``None`` (one buffer).

  Args:
    w: the workload.
    c: the cluster.
    kind: the communicator kind (`allreduce.kind_time`).
    candidates: bucket sizes in bytes, ``None`` for one buffer; the first of equal times wins.
    **options: passed to `step_time` (``wire_bytes``, ``interference``, ``software``,
      ``flat``, ``nccl``); ``overlap`` is ``"backward"``.

  Returns:
    The candidate of lowest ``step_time(...).total``.

  >>> from lab.costmodel import hardware as hw, step
  >>> c = hw.cluster("h200_ndr", gpus=1024)
  >>> step.best_bucket_bytes(step.RESNET50.replace(compute=0.012), c, "xla") >> 20   # MiB
  4
  """
  candidates = tuple(candidates)
  if not candidates or any(b is not None and not b > 0 for b in candidates):
    raise ValueError(f"candidates must be bucket sizes > 0 or None; got {candidates!r}")
  options = {**options, "overlap": "backward"}
  return min(candidates, key=lambda b: step_time(w, c, kind, bucket_bytes=b, **options).total)


def efficiency(w: Workload, c: Cluster, kind: str, *, reference: int = 1, **options) -> float:
  """Weak-scaling efficiency on `c` against `reference` GPUs of the same nodes:
  ``step(reference) / step(c)`` (1 GPU: no communication at all)."""
  base = step_time(w, c.with_gpus(reference), kind if reference > c.gpus_per_node else
                   _local_kind(kind), **options)
  return base.total / step_time(w, c, kind, **options).total


def _local_kind(kind: str) -> str:
  """Within one node every kind reduces over the node's links only."""
  return "flat" if kind == "flat" else "single_node"


def scaling(w: Workload, c: Cluster, kinds, gpus, **options) -> dict[str, list[float]]:
  """Efficiency of each kind at each GPU count (`gpus`: multiples of the node size, or fewer)."""
  return {k: [efficiency(w, c.with_gpus(p), k, **options) for p in gpus] for k in kinds}
