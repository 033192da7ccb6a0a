"""Who am I: MPI rank and size, node-local ranks, local devices — the `Communicator`.

A `Communicator` is a small frozen record that every other layer reads. It owns a private
clone of the MPI communicator it was built from (two, in fact: one for host-level and one
for in-step collectives), so mnjax's traffic never mixes with the user's own mpi4py
messages (mpi4jax's convention). Nothing here traces JAX code.

Building one is collective: every rank of `mpi_comm` must call `create_communicator` with
the same arguments, in the same order relative to other collective calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpi4py import MPI

from mnjax import failfast

__all__ = ["Communicator", "create_communicator", "KINDS", "check_communicator"]

#: Every communicator kind mnjax knows, with what it does (README, "Communicator kinds").
KINDS: dict[str, str] = {
    "flat": "one MPI process per device; one MPI allreduce of the fused gradient buffer",
    "hierarchical": "psum over local devices, then MPI allreduce among processes",
    "two_dimensional": "reduce-scatter over local devices, shards allreduced across nodes",
    "single_node": "psum over the local devices of a single process, no MPI traffic",
    "xla": "JAX-native: jax.distributed + a global mesh, psum across all devices",
}

#: Kinds that drive several local devices from one process (through `mnjax.data_parallel`).
MULTI_DEVICE_KINDS = ("hierarchical", "two_dimensional", "single_node", "xla")


@dataclasses.dataclass(frozen=True)
class Communicator:
  """The process's place in the job, and the MPI communicator mnjax uses.

  Attributes:
    kind: the communicator kind (see `KINDS`).
    rank: this process's rank among all processes.
    size: the number of processes.
    intra_rank: rank among the processes on this node (MPI shared-memory split).
    intra_size: number of processes on this node.
    inter_rank: index of this node among the nodes (0 .. inter_size - 1).
    inter_size: number of nodes.
    local_device_count: JAX devices this process drives (1 for ``flat``).
    axis_name: the mapped-axis name user code may reduce over (e.g. BatchNorm).
    mpi_comm: mnjax's clone of the MPI communicator for host-level collectives
      (`broadcast`, `allreduce_metrics`); not part of equality.
    device_comm: a second clone, used only by collectives inside jitted steps. Steps run
      asynchronously, so a host collective may be issued while a step's allreduce is in
      flight; on separate communicators the two can never be matched with each other.
    device_comms: for the multi-device kinds, one more clone per local device index:
      local device ``i`` of every process exchanges its shard on ``device_comms[i]``
      (``two_dimensional``); ``hierarchical`` uses ``device_comms[0]``.
    devices: the local JAX devices this process drives.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> per_rank = global_batch // comm.size; is_logger = comm.is_root
  """

  kind: str
  rank: int
  size: int
  intra_rank: int
  intra_size: int
  inter_rank: int
  inter_size: int
  local_device_count: int
  axis_name: str
  handle: int  # MPI handle of the clone: two clones are different communicators
  mpi_comm: Any = dataclasses.field(compare=False, hash=False, repr=False)
  device_comm: Any = dataclasses.field(compare=False, hash=False, repr=False)
  device_comms: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)
  devices: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)

  @property
  def num_replicas(self) -> int:
    """Model replicas in the job: processes x local devices."""
    return self.size * self.local_device_count

  @property
  def multi_device(self) -> bool:
    """True for kinds whose steps run over local devices (`mnjax.data_parallel`)."""
    return self.kind in MULTI_DEVICE_KINDS

  @property
  def mesh(self):
    """A `jax.sharding.Mesh` with axis ``axis_name``: this process's devices, or for
    ``xla`` every device of every process (process-major, as `jax.devices()` orders them)."""
    import jax  # noqa: PLC0415 (topology itself never needs JAX)
    import numpy as np  # noqa: PLC0415

    devices = jax.devices() if self.kind == "xla" else self.devices
    return jax.sharding.Mesh(np.array(devices, dtype=object), (self.axis_name,))

  @property
  def is_root(self) -> bool:
    """True on rank 0, the rank that logs and writes files."""
    return self.rank == 0


def check_communicator(comm: Any, caller: str) -> Communicator:
  """Raises a `TypeError` saying how to build one unless `comm` is a `Communicator`.

  Example:
    >>> check_communicator(None, "allreduce_gradients")
    TypeError: allreduce_gradients needs an mnjax Communicator as its first argument, ...
  """
  if not isinstance(comm, Communicator):
    raise TypeError(
        f"{caller} needs an mnjax Communicator as its first argument, got"
        f" {type(comm).__name__} ({comm!r}). Build one once per process, on every rank:"
        " `comm = mnjax.create_communicator('flat')`, then pass it:"
        f" `{caller}(comm, ...)`."
    )
  return comm


def _check_kind(kind: Any) -> str:
  if not isinstance(kind, str) or kind not in KINDS:
    raise ValueError(
        f"create_communicator: unknown communicator kind {kind!r}. Expected one of"
        f" {', '.join(repr(k) for k in KINDS)}; for one MPI process per device use"
        " create_communicator('flat')."
    )
  return kind


def _start_jax_distributed(mpi_comm: MPI.Intracomm, timeout: int) -> None:
  """`jax.distributed` for the ``xla`` kind, or the same clear error on every rank.

  It must start before JAX touches a device; the ranks first agree (over MPI) that none has,
  so that no rank waits alone in ``jax.distributed.initialize`` for peers that raised.
  """
  import jax  # noqa: PLC0415
  from jax._src import xla_bridge  # noqa: PLC0415 (no public query for this)

  if jax.distributed.is_initialized():
    return
  late = mpi_comm.allgather(xla_bridge.backends_are_initialized())
  if any(late):
    raise ValueError(
        "create_communicator('xla') must run before JAX uses any device, because it starts"
        " jax.distributed; JAX was already initialised on ranks"
        f" {[r for r, x in enumerate(late) if x]}. Create the communicator first thing in"
        " the script (before creating arrays or calling jax.devices()), or call"
        " jax.distributed.initialize() yourself before it."
    )
  # CPU collectives across processes need gloo; GPUs use NCCL regardless of this setting.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
        cluster_detection_method="mpi4py", initialization_timeout=timeout
    )
  except Exception as error:  # every rank gets here: the coordinator is shared
    raise RuntimeError(
        f"create_communicator('xla'): jax.distributed could not start ({error}). It needs"
        " every rank of the job to reach create_communicator('xla') and rank 0's host to"
        " be reachable from the others on a free port; use kind 'hierarchical' to keep"
        " cross-process traffic on MPI."
    ) from error


def _local_devices(kind: str, requested: int | None, mpi_comm: MPI.Intracomm) -> tuple:
  """The devices this process drives; every check here is local and identical on all ranks
  of a homogeneous job, so a bad request raises everywhere before any collective."""
  import jax  # noqa: PLC0415

  available = jax.local_devices()
  if kind not in MULTI_DEVICE_KINDS:
    if requested not in (None, 1):
      raise ValueError(
          f"create_communicator: kind {kind!r} drives one device per process, got"
          f" local_devices={requested}; use kind 'hierarchical' or 'two_dimensional' to"
          " drive several local devices from one process."
      )
    return (available[0],)
  if kind == "single_node" and mpi_comm.size > 1:
    raise ValueError(
        f"create_communicator: kind 'single_node' reduces over the devices of one process"
        f" only, but this job has {mpi_comm.size} processes. Run it without mpirun, or"
        " use kind 'hierarchical' to add MPI between processes."
    )
  n = len(available) if requested is None else requested
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"create_communicator: local_devices must be a positive int, got {requested!r}.")
  if n > len(available):
    raise ValueError(
        f"create_communicator: {n} local devices requested, but this process has"
        f" {len(available)} ({available[0].platform}). Request at most {len(available)};"
        " on CPU, emulate more with"
        f" XLA_FLAGS=--xla_force_host_platform_device_count={n} set before JAX starts."
    )
  return tuple(available[:n])


def create_communicator(
    kind: str = "flat",
    mpi_comm: MPI.Intracomm | None = None,
    *,
    axis_name: str = "batch",
    local_devices: int | None = None,
    distributed_timeout: int = 120,
    abort_on_error: bool = True,
) -> Communicator:
  """Builds the communicator for data-parallel training (collective: call on every rank).

  Args:
    kind: how gradients are reduced; one of `KINDS`. ``flat``: one MPI process per device.
      ``hierarchical``, ``two_dimensional``, ``single_node``: one process drives its local
      devices; run the step with `mnjax.data_parallel`.
    mpi_comm: the MPI communicator whose processes train together (default:
      ``MPI.COMM_WORLD``); mnjax uses a private clone of it. ``MPI.COMM_SELF`` gives a
      size-1 communicator.
    axis_name: name of the mapped local-device axis, for user code that reduces over it
      (e.g. flax ``BatchNorm(axis_name=comm.axis_name)``).
    local_devices: for the multi-device kinds, how many local devices to drive (default:
      all of ``jax.local_devices()``; ``xla`` always uses all).
    distributed_timeout: ``xla`` only: seconds `jax.distributed` waits for every process.
    abort_on_error: when the job has several processes, an uncaught exception on any rank
      aborts every rank (`mnjax.failfast`) instead of leaving the others waiting in a
      collective forever. Pass False to keep Python's own handler.

  Returns:
    A frozen, hashable `Communicator`.

  Example:
    >>> import mnjax
    >>> comm = mnjax.create_communicator("flat")  # under mpirun -n 4: comm.size == 4
    >>> comm.rank < comm.size
    True
  """
  kind = _check_kind(kind)
  if mpi_comm is None:
    mpi_comm = MPI.COMM_WORLD
  if not isinstance(mpi_comm, MPI.Intracomm):
    raise TypeError(
        "create_communicator: mpi_comm must be an mpi4py Intracomm (e.g."
        f" MPI.COMM_WORLD), got {type(mpi_comm).__name__}."
    )
  if not isinstance(axis_name, str) or not axis_name:
    raise ValueError(f"create_communicator: axis_name must be a non-empty str, got {axis_name!r}.")

  if kind == "xla":
    if local_devices is not None:
      raise ValueError("create_communicator: kind 'xla' uses every local device; drop local_devices.")
    _start_jax_distributed(mpi_comm, distributed_timeout)
  devices = _local_devices(kind, local_devices, mpi_comm)
  clone = mpi_comm.Clone()
  node = clone.Split_type(MPI.COMM_TYPE_SHARED, key=clone.rank)
  intra_rank, intra_size = node.rank, node.size
  # Node index: count the node leaders (node-local rank 0) that come before ours.
  leader = int(intra_rank == 0)
  inter_size = clone.allreduce(leader)
  before = clone.exscan(leader)
  inter_rank = node.bcast(before or 0, root=0)
  node.Free()
  if abort_on_error and clone.size > 1:
    failfast.install()
  return Communicator(
      kind=kind,
      rank=clone.rank,
      size=clone.size,
      intra_rank=intra_rank,
      intra_size=intra_size,
      inter_rank=inter_rank,
      inter_size=inter_size,
      local_device_count=len(devices),
      axis_name=axis_name,
      handle=int(clone.py2f()),
      mpi_comm=clone,
      device_comm=clone.Clone(),
      device_comms=tuple(clone.Clone() for _ in devices) if kind in MULTI_DEVICE_KINDS else (),
      devices=devices,
  )
