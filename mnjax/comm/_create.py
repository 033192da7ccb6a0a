"""Building a `Communicator` (collective): the kind, the node topology and the devices, agreed
by every rank; ``jax.distributed`` for ``xla``; the abort-on-error hook."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from mnjax.comm import _coordinator as coordinator
from mnjax.comm import _cuda_mpi as cuda_mpi
from mnjax.comm import _departures as departures
from mnjax.comm import _devices as devices_lib
from mnjax.comm import _failfast as failfast
from mnjax.comm import _launcher as launcher
from mnjax.comm import _process_view as process_view
from mnjax.comm._communicator import KINDS, Communicator, assemble
from mnjax.comm._instep import _compat as compat
from mnjax.comm._instep import _native as native
from mnjax.comm._topology import node_split, node_topology

__all__ = ["create_communicator", "resolve_kind"]


def _check_kind(kind: Any) -> str:
  if not isinstance(kind, str) or (kind not in KINDS and kind != "auto"):
    raise ValueError(
        f"create_communicator: unknown communicator kind {kind!r}. Expected one of"
        f" {', '.join(repr(k) for k in KINDS)} or 'auto'; for one MPI process per device"
        " use create_communicator('flat')."
    )
  return kind


def resolve_kind(kind: str) -> str:
  """`kind`, with ``auto`` replaced by ``xla`` where JAX will run on GPUs, else ``flat`` (local).

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
  """The same error on every rank unless every rank's (requested, resolved) kind agrees."""
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
  """`jax.distributed` for ``xla`` (once the ranks agree none started JAX), or the same error on
  every rank. `local_device_ids`: the GPU ordinals this process drives."""
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


def _check_replicas(replicas: Any, kind: str, size: int, local_devices: Any) -> None:
  """`replicas` checked against the kind and the process count (the same on every rank)."""
  if replicas is None:
    return
  if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
    raise ValueError(f"create_communicator: replicas must be a positive int (the job's"
                     f" replica count), got {replicas!r}.")
  divisors = [p for p in range(1, replicas + 1) if replicas % p == 0]
  if replicas % size:
    raise ValueError(
        f"create_communicator: replicas={replicas} does not divide over {size} processes;"
        f" each process runs replicas / processes of them. Launch a number of processes"
        f" that divides {replicas} ({', '.join(map(str, divisors))}), or pick a replica"
        f" count that {size} divides.")
  if kind == "xla":
    raise ValueError("create_communicator: replicas= is not supported by kind 'xla' (its"
                     " devices are jax.distributed's); use 'hierarchical'.")
  if kind == "flat" and replicas != size:
    raise ValueError(
        f"create_communicator: kind 'flat' runs one replica per process, so replicas"
        f"={replicas} needs {replicas} processes, got {size}. For {replicas // size}"
        " replicas per process use kind 'hierarchical' (its local devices: emulated ones"
        " on CPUs).")
  if local_devices is not None and local_devices != replicas // size:
    raise ValueError(
        f"create_communicator: local_devices={local_devices} but replicas={replicas} over"
        f" {size} processes gives {replicas // size} per process; drop local_devices.")


def _agree_replicas(clone: MPI.Intracomm, replicas: int | None) -> None:
  everyone = clone.allgather(replicas)
  if len(set(everyone)) > 1:
    raise ValueError(
        f"create_communicator: the ranks passed different replica counts ({everyone}, by"
        " rank); every rank must pass the same replicas= (one flag for the whole job).")


def create_communicator(
    kind: str = "flat",
    mpi_comm: MPI.Intracomm | None = None,
    *,
    axis_name: str = "batch",
    local_devices: int | None = None,
    distributed_timeout: int = 120,
    abort_on_error: bool = True,
    share_devices: bool = False,
    replicas: int | None = None,
) -> Communicator:
  """Builds the (frozen, hashable) `Communicator` for data-parallel training; call on every rank.

  Args:
    kind: one of `KINDS`, or ``auto`` (``xla`` on GPUs, ``flat`` on CPUs; ``hierarchical``
      with `replicas`).
    mpi_comm: the MPI communicator to train over (default ``MPI.COMM_WORLD``); mnjax clones it.
    axis_name: name of the mapped local-device axis (under ``xla``: every device of the job).
    local_devices: multi-device kinds: local devices to drive (default: this process's share).
    distributed_timeout: ``xla`` only: seconds `jax.distributed` waits for every process.
    abort_on_error: with several processes, an uncaught exception on any rank aborts all.
    share_devices: allow several processes on one GPU (each preallocates its share).
    replicas: the job's replica count V, divisible by the process count P: each process
      drives V / P local devices (emulated on CPUs) and gradient sums are exact, so a run
      gives the same bits on any such P (docs/design/allreduce.md, Exact sums). Not with
      ``xla``; with ``flat`` only for V = P.

  Call it before any other JAX call: it picks each process's devices before JAX starts and
  sets ``jax_default_device``. ``MNJAX_EMULATE_NODES=k`` emulates ``k`` nodes;
  ``MNJAX_WAIT_TIMEOUT=s`` bounds an in-step send, recv or gradient allreduce (default 300 s).

  Example:
    >>> import mnjax
    >>> comm = mnjax.create_communicator("flat")  # under mpirun -n 4: comm.size == 4
    >>> comm.rank < comm.size
    True
  """
  kind = _check_kind(kind)
  if kind == "auto" and replicas is not None:  # V / P replicas per process, on any P
    kind = "hierarchical"
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
  # Registered before jax.distributed starts, so at exit it runs after jax's shutdown.
  departures.announce()
  devices_lib.agree(clone, native.wait_timeout)  # MNJAX_WAIT_TIMEOUT, refused on every rank
  resolved = devices_lib.agree(clone, resolve_kind, kind)
  _check_same_kind(clone.allgather((kind, resolved)))
  kind = resolved
  _agree_replicas(clone, replicas)
  devices_lib.agree(clone, _check_replicas, replicas, kind, clone.size, local_devices)
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
  if replicas is not None and kind != "flat":
    local_devices = replicas // clone.size
    if not started[0]:
      devices_lib.emulate_cpu_devices(local_devices)  # used only where JAX runs on CPUs
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
    # mpi4jax's CUDA handlers carry these kinds: check them now rather than at the first step.
    devices_lib.agree(clone, cuda_mpi.configure)
  import jax  # noqa: PLC0415 (started by devices_lib.choose_devices)

  # The process's first communicator decides; a later one does not move existing arrays.
  if jax.config.jax_default_device is None:
    jax.config.update("jax_default_device", devices[0])
  if abort_on_error and clone.size > 1:
    failfast.install()
  comm = assemble(kind, clone, (intra_rank, intra_size, inter_rank, inter_size), devices,
                  axis_name, exact=replicas is not None)
  process_view.watch(comm)
  return comm
