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

from mnjax.comm import _compat as compat
from mnjax.comm import _coordinator as coordinator
from mnjax.comm import _cuda_mpi as cuda_mpi
from mnjax.comm import _departures as departures
from mnjax.comm import _devices as devices_lib
from mnjax.comm import _failfast as failfast
from mnjax.comm import _launcher as launcher
from mnjax.comm import _process_view as process_view
from mnjax.comm._methods import CommunicatorMethods
from mnjax.comm._topology import EMULATE_NODES, node_split, node_topology

__all__ = [
    "EMULATE_NODES", "KINDS", "Communicator", "assemble", "check_communicator",
    "create_communicator", "node_topology", "resolve_kind",
]

#: Every communicator kind mnjax knows, with what it does (README, "Communicator kinds").
KINDS: dict[str, str] = {
    "flat": "one MPI process per device; one MPI allreduce of the fused gradient buffer",
    "hierarchical": "psum over local devices, then MPI allreduce among processes",
    "two_dimensional": "reduce-scatter over local devices, shards allreduced across nodes",
    "single_node": "every process on one node: psum over local devices, MPI among the"
                   " node's processes (none with one process)",
    "xla": "JAX-native: jax.distributed + a global mesh, psum across all devices",
}


#: Kinds that drive several local devices from one process (through `mnjax.data_parallel`).
MULTI_DEVICE_KINDS = ("hierarchical", "two_dimensional", "single_node", "xla")


@dataclasses.dataclass(frozen=True)
class Communicator(CommunicatorMethods):
  """The process's place in the job, and the MPI communicator mnjax uses.

  Attributes:
    kind: the communicator kind (see `KINDS`).
    rank: this process's rank among all processes. Under the MPI kinds JAX's own
      ``jax.process_index()`` stays 0 on every rank (they do not start jax.distributed):
      code ported from ``pmap`` reads `rank` instead, and `is_root` for
      ``jax.process_index() == 0``.
    size: the number of processes (``jax.process_count()`` stays 1 under the MPI kinds).
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

  ChainerMN's communicator methods are methods here too (`mnjax.comm._methods`):
  ``comm.split(color, key)`` (a `Communicator` for a group of ranks), ``comm.send``,
  ``recv``, ``bcast``, ``gather``, ``allgather``, ``alltoall``, ``scatter`` and the
  ``*_obj`` variants (`mnjax.collectives`).

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> comm.kind, comm.rank < comm.size, comm.num_replicas % comm.size
    ('flat', True, 0)
    >>> per_rank_batch = 256 // comm.size          # e.g. of a global batch of 256
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
  def summary(self) -> str:
    """One line for a run header: ranks, nodes, devices per rank and their platform, kind."""
    platform = self.devices[0].platform if self.devices else "?"
    return (f"{self.size} rank(s) on {self.inter_size} node(s) x {self.local_device_count}"
            f" {platform} device(s), kind {self.kind}")

  @property
  def is_root(self) -> bool:
    """True on rank 0, the rank that logs and writes files."""
    return self.rank == 0


def check_communicator(comm: Any, caller: str) -> Communicator:
  """Raises a `TypeError` saying how to build one unless `comm` is a `Communicator`.

  Example:
    >>> check_communicator(None, "allreduce_gradients")
    Traceback (most recent call last):
    ...
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
  if not isinstance(kind, str) or (kind not in KINDS and kind != "auto"):
    raise ValueError(
        f"create_communicator: unknown communicator kind {kind!r}. Expected one of"
        f" {', '.join(repr(k) for k in KINDS)} or 'auto'; for one MPI process per device"
        " use create_communicator('flat')."
    )
  return kind


def resolve_kind(kind: str) -> str:
  """`kind`, with ``auto`` replaced by the kind mnjax recommends for this machine.

  ``xla`` where JAX will run on GPUs: NCCL through XLA's collectives, which XLA schedules
  alongside compute; mpi4jax's GPU handlers synchronise the stream and stage every call
  through host memory (README, "On GPUs"). ``flat`` on CPUs: the fastest MPI kind measured
  here (`python -m lab.bench kinds`). Local: reads the CUDA driver and JAX's state only.

  Example:
    >>> resolve_kind("auto")   # on a CPU machine
    'flat'
  """
  kind = _check_kind(kind)
  if kind != "auto":
    return kind
  if _jax_started():
    import jax  # noqa: PLC0415

    return "xla" if jax.local_devices()[0].platform == "gpu" else "flat"
  return "xla" if devices_lib.gpus_expected(devices_lib.gpu_inventory()) else "flat"


def _check_same_kind(asked: list[tuple[str, str]]) -> None:
  """Every rank's (requested, resolved) kind, by rank: one error on every rank unless every
  rank resolved the same kind, naming what each rank asked for."""
  chosen = [k for _, k in asked]
  if len(set(chosen)) == 1:
    return
  if all(a == "auto" for a, _ in asked):
    raise ValueError(
        f"create_communicator('auto') chose different kinds on different ranks ({chosen}):"
        " some nodes see GPUs and others do not. Pass the kind explicitly."
    )
  groups: dict[str, list[int]] = {}
  for rank, (a, k) in enumerate(asked):
    groups.setdefault(f"{a!r}" + (f" (which chose {k!r})" if a == "auto" else ""), []).append(rank)
  per_kind = ", ".join(f"{what} on ranks {ranks}" for what, ranks in groups.items())
  raise ValueError(
      f"create_communicator: the ranks asked for different kinds: {per_kind}. Every rank must"
      " build the same kind (their gradient exchanges differ and would never match): pass"
      " the same kind on every rank (one --comm flag for the whole job, not one per rank)."
  )


def _start_jax_distributed(mpi_comm: MPI.Intracomm, timeout: int,
                           local_device_ids: tuple[int, ...] | None) -> None:
  """`jax.distributed` for the ``xla`` kind, or the same clear error on every rank.

  It must start before JAX touches a device; the ranks first agree (over MPI) that none has,
  so that no rank waits alone in ``jax.distributed.initialize`` for peers that raised.
  `local_device_ids` (GPUs only) are the ordinals this process drives: without them JAX
  assumes one process per GPU and opens only ``[local_rank]``, wrong for one process per
  node and for launchers that give each task its own GPU (it would ask for a GPU that the
  task cannot see).
  """
  import jax  # noqa: PLC0415

  if jax.distributed.is_initialized():
    return
  late = mpi_comm.allgather(_jax_started())
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
  address = coordinator.choose(mpi_comm, timeout)  # checked from every rank (_coordinator)
  try:
    jax.distributed.initialize(
        coordinator_address=address, num_processes=mpi_comm.size, process_id=mpi_comm.rank,
        cluster_detection_method="deactivate", initialization_timeout=timeout,
        local_device_ids=list(local_device_ids) if local_device_ids else None,
    )
  except Exception as error:  # every rank gets here: the coordinator is shared
    raise RuntimeError(
        f"create_communicator('xla'): jax.distributed could not start ({error}). It needs"
        " every rank of the job to reach create_communicator('xla') and rank 0's host to"
        " be reachable from the others on a free port; use kind 'hierarchical' to keep"
        " cross-process traffic on MPI."
    ) from error


def _jax_started() -> bool:
  return compat.jax_backends_started()


def create_communicator(
    kind: str = "flat",
    mpi_comm: MPI.Intracomm | None = None,
    *,
    axis_name: str = "batch",
    local_devices: int | None = None,
    distributed_timeout: int = 120,
    abort_on_error: bool = True,
    share_devices: bool = False,
) -> Communicator:
  """Builds the communicator for data-parallel training (collective: call on every rank).

  Args:
    kind: how gradients are reduced; one of `KINDS`. ``flat``: one MPI process per device.
      ``hierarchical``, ``two_dimensional``, ``single_node``: one process drives its local
      devices; run the step with `mnjax.data_parallel`. ``single_node``: every process on
      one node (ChainerMN's: one process, or one per device, or several devices each);
      refused across nodes. ``auto``: ``xla`` (NCCL) where
      JAX will run on GPUs, ``flat`` on CPUs (`resolve_kind`).
    mpi_comm: the MPI communicator whose processes train together (default:
      ``MPI.COMM_WORLD``); mnjax uses a private clone of it. ``MPI.COMM_SELF`` gives a
      size-1 communicator.
    axis_name: name of the mapped local-device axis (under ``xla``: every device of the
      job); user reductions over it are process-local under the other multi-device kinds,
      which `mnjax.data_parallel` refuses outside `mnjax.process_local`.
    local_devices: for the multi-device kinds, how many local devices to drive (default:
      this process's share of its node's devices, `mnjax.comm._devices.plan_devices`; ``xla``
      always uses its whole share).
    distributed_timeout: ``xla`` only: seconds `jax.distributed` waits for every process.
    abort_on_error: when the job has several processes, an uncaught exception on any rank
      aborts every rank (`mnjax.comm._failfast`) instead of leaving the others waiting in a
      collective forever. Pass False to keep Python's own handler.
    share_devices: allow several processes to drive one GPU (tests, small models); each
      then preallocates its share of the memory. Without it, that layout is an error.

  Devices: each process drives its own (``flat``: node-local rank *i* on GPU *i*), chosen
  before JAX starts so that JAX opens only those GPUs; ``jax_default_device`` is set to
  ``devices[0]``. Call it before any other JAX call. ``MNJAX_EMULATE_NODES=k`` (a testing
  aid) splits the ranks into ``k`` nodes of consecutive ranks.

  JAX's process view: under the MPI kinds ``jax.process_index()`` and
  ``jax.process_count()`` stay 0 and 1 on every rank (only ``xla`` starts jax.distributed);
  use ``comm.rank``, ``comm.size`` and ``comm.is_root`` instead. A correct port hears
  nothing; where the script calls ``jax.process_index()`` or ``jax.process_count()``, every
  rank but 0 warns once per calling line (a `UserWarning` starting ``mnjax:
  jax.process_index``; `mnjax.comm._process_view`).

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

  if mpi_comm is MPI.COMM_WORLD:  # a launcher whose PMI this MPI does not speak: singletons
    launcher.check_world(mpi_comm.Get_size(), MPI.Get_library_version())
  if kind == "xla" and local_devices is not None:
    raise ValueError("create_communicator: kind 'xla' uses every device this process drives;"
                     " drop local_devices.")
  if not isinstance(share_devices, bool):
    raise TypeError(f"create_communicator: share_devices must be a bool, got {share_devices!r}.")
  clone = mpi_comm.Clone()
  # A normal exit tells the peers (`mnjax.comm._departures`). Registered before
  # jax.distributed starts (``xla``), so that at exit it runs after jax's own shutdown.
  departures.announce()
  resolved = devices_lib.agree(clone, resolve_kind, kind)
  _check_same_kind(clone.allgather((kind, resolved)))
  kind = resolved
  node = devices_lib.agree(clone, node_split, clone)
  intra_rank, intra_size, inter_rank, inter_size = node_topology(clone, node)
  if kind == "single_node" and inter_size > 1:  # inter_size is the same on every rank
    node.Free()
    raise ValueError(
        f"create_communicator: kind 'single_node' keeps every exchange on one node, but the"
        f" {clone.size} processes are on {inter_size} nodes. Launch them all on one node, or"
        " use kind 'hierarchical' (psum over each process's devices, MPI between processes,"
        " on any number of nodes) or 'flat' (one process per device)."
    )
  started = clone.allgather(_jax_started())
  if len(set(started)) > 1:
    raise ValueError(
        "create_communicator: JAX was already started (a jax.numpy call, jax.devices(), an"
        f" array) on ranks {[r for r, x in enumerate(started) if x]} but not on the others,"
        " so they would choose devices differently. Call create_communicator first thing in"
        " the script, on every rank."
    )
  devices = devices_lib.choose_devices(
      kind, local_devices, share_devices, clone, node, started=started[0],
      start_distributed=lambda ids: _start_jax_distributed(clone, distributed_timeout, ids))
  node.Free()
  counts = clone.allgather(len(devices))
  if len(set(counts)) > 1:
    raise ValueError(
        f"create_communicator({kind!r}): the processes drive different numbers of devices"
        f" ({counts}, by rank); every process must drive the same number (the mapped step"
        " and the collectives assume one layout). Launch the same number of processes on"
        " every node with the same GPUs each, or pass local_devices=."
    )
  if devices[0].platform == "gpu" and (kind in ("flat", "hierarchical", "two_dimensional")
                                       or (kind == "single_node" and clone.size > 1)):
    # mpi4jax's CUDA handlers carry these kinds' in-step collectives: check them now, on
    # every rank, rather than at the first step (`mnjax.comm._cuda_mpi`).
    devices_lib.agree(clone, cuda_mpi.configure)
  import jax  # noqa: PLC0415 (started by devices_lib.choose_devices)

  # A plain jax.jit in user code (no committed inputs) runs on the device this rank drives.
  # The process's first communicator decides; a later one (or the user's own setting) does
  # not move arrays and steps that already live there.
  if jax.config.jax_default_device is None:
    jax.config.update("jax_default_device", devices[0])
  if abort_on_error and clone.size > 1:
    failfast.install()
  comm = assemble(kind, clone, (intra_rank, intra_size, inter_rank, inter_size), devices,
                  axis_name)
  process_view.watch(comm)
  return comm


def assemble(kind: str, clone: MPI.Intracomm, topology: tuple[int, int, int, int],
             devices: tuple, axis_name: str) -> Communicator:
  """The `Communicator` over `clone` (which it then owns), with its in-step clones.
  `topology` is `node_topology`'s. Collective over `clone` (it clones it).

  Example:
    >>> sub = assemble("flat", comm.mpi_comm.Clone(), (0, 1, 0, 1), comm.devices, "batch")
    >>> sub.size == comm.size and sub != comm     # another MPI communicator
    True
  """
  intra_rank, intra_size, inter_rank, inter_size = topology
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

