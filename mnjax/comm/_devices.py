"""Which devices a process drives, chosen from its node-local rank before JAX opens (and
preallocates on) any GPU; `plan_devices` is the pure choice (docs/design/gpu.md)."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Sequence

__all__ = ["Layout", "emulate_cpu_devices", "gpu_inventory", "plan_devices"]

#: Kinds that drive one device per process; the others drive several (`data_parallel`).
ONE_DEVICE_KINDS = ("flat",)


@dataclasses.dataclass(frozen=True)
class Layout:
  """What one process sees (`visible` devices of `platform`, ``"gpu"`` or ``"cpu"``), where it
  sits on its node, and whether the node's processes see the same devices (`shared`)."""

  platform: str
  visible: int
  intra_rank: int
  intra_size: int
  shared: bool


def plan_devices(kind: str, layout: Layout, *, requested: int | None = None,
                 share_devices: bool = False) -> tuple[int, ...]:
  """Indices of the visible devices this process drives; else a `ValueError` naming a launch.

  Example:
    >>> plan_devices("flat", Layout("gpu", 8, intra_rank=3, intra_size=8, shared=True))
    (3,)
    >>> plan_devices("two_dimensional", Layout("gpu", 8, intra_rank=0, intra_size=1, shared=True))
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> plan_devices("flat", Layout("gpu", 1, intra_rank=5, intra_size=8, shared=False))
    (0,)
  """
  where = (f"node-local rank {layout.intra_rank} of {layout.intra_size}, which sees"
           f" {layout.visible} {layout.platform.upper()} device(s)")
  if layout.visible < 1:
    raise ValueError(f"create_communicator: no {layout.platform} device is visible to this"
                     " process; check the launcher's GPU binding (CUDA_VISIBLE_DEVICES).")
  if kind in ONE_DEVICE_KINDS:
    if requested not in (None, 1):
      raise ValueError(
          f"create_communicator: kind {kind!r} drives one device per process, got"
          f" local_devices={requested}; use kind 'hierarchical' or 'two_dimensional' to"
          " drive several local devices from one process."
      )
    if layout.platform == "cpu" or (layout.shared and share_devices):
      return (layout.intra_rank % layout.visible,)
    if not layout.shared:
      return (0,)
    if layout.intra_size > layout.visible:
      raise ValueError(
          f"create_communicator: {layout.intra_size} processes on this node share"
          f" {layout.visible} GPU(s) ({where}); kind 'flat' needs one GPU per process."
          f" Launch at most {layout.visible} processes per node (mpirun -n"
          f" {layout.visible} per node, or srun --ntasks-per-node={layout.visible}"
          " --gpus-per-task=1), or one process per node with kind 'xla' or"
          " 'two_dimensional'. To share GPUs deliberately (tests, small models), pass"
          " create_communicator(..., share_devices=True)."
      )
    return (layout.intra_rank,)

  if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool)
                                or requested < 1):
    raise ValueError(
        f"create_communicator: local_devices must be a positive int, got {requested!r}.")
  if layout.platform == "cpu" or not layout.shared or layout.intra_size == 1:
    n = layout.visible if requested is None else requested
    if n > layout.visible:
      raise ValueError(
          f"create_communicator: {n} local devices requested, but this process has"
          f" {layout.visible} ({layout.platform}). Request at most {layout.visible};"
          " on CPU, emulate more with"
          f" XLA_FLAGS=--xla_force_host_platform_device_count={n} set before JAX starts."
      )
    return tuple(range(n))
  per = layout.visible // layout.intra_size if requested is None else requested
  if per < 1 or per * layout.intra_size > layout.visible:
    if share_devices:
      per = max(1, min(per, layout.visible))
      return tuple((layout.intra_rank * per + i) % layout.visible for i in range(per))
    raise ValueError(
        f"create_communicator: kind {kind!r} with {layout.intra_size} processes on this node"
        f" cannot give each {per or 'one or more'} of its own GPUs ({where}). Launch one"
        " process per node (it drives every GPU), or choose local_devices so that"
        " processes x local_devices <= GPUs per node."
    )
  return tuple(range(layout.intra_rank * per, (layout.intra_rank + 1) * per))


def gpu_inventory() -> tuple[str, ...]:
  """The visible GPUs' UUIDs (else PCI bus ids) by CUDA ordinal, read safely before JAX starts.

  Example:
    >>> gpu_inventory()        # on a CPU machine
    ()
  """
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return ()
  count = ctypes.c_int(0)
  if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
    return ()
  ids = []
  for ordinal in range(count.value):
    device, uuid = ctypes.c_int(0), ctypes.create_string_buffer(16)
    name = ctypes.create_string_buffer(64)
    if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
      return tuple(ids)
    # The UUID tells MIG slices of one GPU apart (they share its PCI bus id).
    if hasattr(cuda, "cuDeviceGetUuid_v2") and cuda.cuDeviceGetUuid_v2(uuid, device) == 0:
      ids.append("GPU-" + uuid.raw.hex())
    elif cuda.cuDeviceGetPCIBusId(name, 64, device) == 0:
      ids.append(name.value.decode().lower())
    else:
      ids.append(f"ordinal-{ordinal}")
  return tuple(ids)


def cuda_plugin_installed() -> bool:
  """Whether jaxlib's CUDA plugin (the ``cuda`` extra) is installed.

  Example:
    >>> cuda_plugin_installed()    # scripts/setup.sh without MNJAX_EXTRAS=cuda
    False
  """
  return any(importlib.util.find_spec(name) is not None
             for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def gpus_expected(inventory: Sequence[str]) -> bool:
  """Whether JAX will start on GPUs: some visible, the CUDA plugin, ``JAX_PLATFORMS`` allowing.

  Example:
    >>> gpus_expected(gpu_inventory())   # on a CPU machine
    False
  """
  platforms = os.environ.get("JAX_PLATFORMS", "").lower()
  allowed = not platforms or any(p in platforms for p in ("cuda", "gpu"))
  return bool(inventory) and cuda_plugin_installed() and allowed


def restrict_visible(ordinals: Sequence[int], sharers: int) -> None:
  """Before JAX starts: open only these GPUs, splitting preallocation between `sharers`.

  Example:
    >>> restrict_visible((3,), sharers=1)  # node-local rank 3: opens GPU 3  # doctest: +SKIP
  """
  import jax  # noqa: PLC0415

  jax.config.update("jax_cuda_visible_devices", ",".join(str(o) for o in ordinals))
  fractions = {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"}
  if sharers > 1 and not fractions & set(os.environ):
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.75 / sharers:.3f}"


def warn_opened_others(driven: int, opened: int) -> None:
  """JAX started before mnjax chose: it holds memory on GPUs this process does not drive.

  Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   warn_opened_others(driven=1, opened=8)
    >>> caught[0].category.__name__, str(caught[0].message)
    ('RuntimeWarning', 'mnjax: JAX started before create_communicator and opened 8 GPUs, ...')
  """
  warnings.warn(
      f"mnjax: JAX started before create_communicator and opened {opened} GPUs, of which"
      f" this process drives {driven}; it has preallocated memory on the others, which the"
      " other ranks on this node need. Call mnjax.create_communicator(...) first thing in"
      " the script (before any jax.numpy call, jax.devices() or array creation), or launch"
      " with one GPU per process (srun --gpus-per-task=1), or set"
      " XLA_PYTHON_CLIENT_PREALLOCATE=false.",
      RuntimeWarning, stacklevel=3)


def emulate_cpu_devices(count: int) -> None:
  """Before JAX starts: at least `count` CPU devices (``XLA_FLAGS``; a larger count stays).

  Example:
    >>> emulate_cpu_devices(1)   # JAX started already: it keeps what it opened
  """
  flag = "--xla_force_host_platform_device_count"
  words = os.environ.get("XLA_FLAGS", "").split()
  current = [int(w.split("=", 1)[1]) for w in words if w.startswith(flag + "=")]
  if current and max(current) >= count:
    return
  kept = [w for w in words if not w.startswith(flag + "=")]
  os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}={count}"])


def agree(comm, fn, *args):
  """``fn(*args)`` on every rank; if it raised on any, the same error on all, naming the ranks.

  Example:
    >>> layout = Layout("gpu", 8, intra_rank=1, intra_size=8, shared=True)
    >>> agree(comm.mpi_comm, plan_devices, "flat", layout)   # raises on every rank, or (i,)
    (1,)
  """
  try:
    result, failure = fn(*args), None
  except Exception as error:  # noqa: BLE001 (any failure on one rank must reach every rank)
    result, failure = None, (type(error).__name__, f"{error}")
  failures = comm.allgather(failure)
  failed = [r for r, f in enumerate(failures) if f is not None]
  if failed:
    kind, message = failure if failure is not None else failures[failed[0]]
    raise (RuntimeError if kind == "RuntimeError" else ValueError)(
        f"{message} [failed on ranks {failed} of {comm.size}]")
  return result


def choose_devices(kind: str, requested: int | None, share: bool, clone, node, *,
                   started: bool, start_distributed) -> tuple:
  """The local JAX devices this process drives; starts JAX with only those GPUs (collective).

  Example:
    >>> choose_devices("flat", None, False, comm.mpi_comm, comm.mpi_comm, started=True,
    ...                start_distributed=lambda ids: None)   # one rank, on a CPU
    (CpuDevice(id=0),)
    >>> choose_devices("flat", None, False, clone, node, started=False,  # doctest: +SKIP
    ...                start_distributed=lambda ids: None)   # node-local rank 1 of 8 GPUs
    (CudaDevice(id=1),)
  """
  import jax  # noqa: PLC0415

  inventory = gpu_inventory()
  gpus = (jax.local_devices()[0].platform == "gpu") if started else gpus_expected(inventory)
  mixed = clone.allgather(gpus)
  if len(set(mixed)) > 1:
    raise ValueError(
        "create_communicator: some ranks will run on GPUs and others on CPUs (ranks with"
        f" GPUs: {[r for r, g in enumerate(mixed) if g]} of {clone.size}). Give every rank"
        " a GPU, or set JAX_PLATFORMS=cpu on every rank."
    )
  if not gpus:
    if kind == "xla":
      start_distributed(None)
    available = agree(clone, _cpu_devices)
    layout = Layout("cpu", len(available), node.rank, node.size, shared=False)
    indices = agree(clone, lambda: plan_devices(
        kind, layout, requested=requested, share_devices=share))
    return tuple(available[i] for i in indices)

  if started:  # what JAX opened (the user may have restricted it), by driver identity
    inventory = tuple(inventory[d.local_hardware_id] if d.local_hardware_id < len(inventory)
                      else f"ordinal-{d.local_hardware_id}" for d in jax.local_devices())
  everyone = node.allgather(inventory)
  layout = Layout("gpu", len(inventory), node.rank, node.size,
                  shared=all(v == inventory for v in everyone))
  ordinals = agree(clone, lambda: plan_devices(
      kind, layout, requested=requested, share_devices=share))
  mine = [inventory[o] if o < len(inventory) else f"ordinal-{o}" for o in ordinals]
  driven = [bus for ids in node.allgather(mine) for bus in ids]
  sharers = max(driven.count(bus) for bus in mine)
  agree(clone, _check_not_shared, sharers, share and kind != "xla", mine, node.size)
  if started:
    if kind == "xla":
      start_distributed(ordinals)  # raises on every rank: too late for jax.distributed
    local = jax.local_devices()
    if len(local) > len(ordinals):
      warn_opened_others(len(ordinals), len(local))
    return tuple(local[o] for o in ordinals)
  if kind == "xla":
    start_distributed(ordinals)
  else:
    restrict_visible(ordinals, sharers)
  local = agree(clone, _gpu_devices, len(ordinals))
  return tuple(local)


def _check_not_shared(sharers: int, share: bool, mine: list, node_size: int) -> None:
  if sharers > 1 and not share:
    raise ValueError(
        f"create_communicator: GPU {mine[0]} would be driven by {sharers} processes of this"
        f" node ({node_size} processes). Give each process its own GPU (srun"
        " --gpus-per-task=1, or at most one process per GPU under mpirun), or pass"
        " share_devices=True to share GPUs deliberately (not with kind 'xla': NCCL refuses"
        " two processes on one GPU)."
    )


def _cpu_devices() -> list:
  import jax  # noqa: PLC0415

  try:
    available = jax.local_devices()
  except Exception as error:  # noqa: BLE001 (re-raised below with the fix)
    # e.g. JAX_PLATFORMS=cuda where no GPU is usable
    raise ValueError(
        f"create_communicator: JAX could not start its backend ({type(error).__name__}:"
        f" {error}; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}). If a GPU was"
        " requested (JAX_PLATFORMS=cuda), check that this node has one and its driver"
        " works (nvidia-smi), and that the CUDA extra is installed (MNJAX_EXTRAS=cuda"
        " scripts/setup.sh); to run on the CPU, set JAX_PLATFORMS=cpu."
    ) from None
  if (available[0].platform == "cpu" and cuda_plugin_installed()
      and os.environ.get("JAX_PLATFORMS", "").lower() != "cpu"):
    raise ValueError(
        "create_communicator: jaxlib's CUDA plugin is installed but JAX started on the CPU:"
        " the CUDA driver found no usable GPU on this node (is nvidia-smi working, and did"
        " the launcher give this task a GPU?). To run on the CPU deliberately, set"
        " JAX_PLATFORMS=cpu."
    )
  return available


def _gpu_devices(expected: int) -> list:
  local = _cpu_devices()
  if local[0].platform != "gpu" or len(local) != expected:
    raise ValueError(
        f"create_communicator: expected JAX to open {expected} GPU(s) on this process, but"
        f" it opened {len(local)} {local[0].platform} device(s). Check the CUDA extra"
        " (MNJAX_EXTRAS=cuda scripts/setup.sh) and the driver (nvidia-smi)."
    )
  return local
