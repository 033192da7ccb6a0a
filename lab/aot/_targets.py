"""GPU targets as files, and "4x8xH200" as a JAX topology and mesh, for compiling without GPUs.

XLA compiles for a GPU that is not there from a description of it (a ``GpuTargetConfig``
text proto: SMs, memory, bandwidth, compute capability, library versions). The files are
in ``lab/aot/targets/`` (``h200.txtpb``, ``h100.txtpb``), each number with its source.
`parse_target` reads ``"8xH200"`` (one node of 8) or ``"4x8xH200"`` (4 nodes x 8 GPUs);
`topology` hands the description to jaxlib's CUDA plugin
(``jax.experimental.topologies.get_topology_desc``), which needs no GPU, no driver and no
CUDA toolkit, only the plugin and pip's CUDA packages (``MNJAX_EXTRAS=cuda
MNJAX_VENV=.venv-cuda scripts/setup.sh``). The plugin checks the CUDA libraries against a
driver at start-up ("Unable to load cuPTI" without one); `topology` sets
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` so it does not.

Processes: one per GPU (``per_process=1``, as ``mpirun -n 8 ... --comm xla`` runs) or one
per node driving its GPUs (``per_process=gpus_per_node``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

__all__ = ["INSTALL", "AotUnavailable", "Target", "gpu_names", "mesh", "parse_target",
           "plugin_installed", "target_config", "topology"]

TARGETS = Path(__file__).resolve().parent / "targets"
#: How to get the CUDA plugin, for the one-line error when it is missing.
INSTALL = "MNJAX_EXTRAS=cuda MNJAX_VENV=.venv-cuda scripts/setup.sh, then .venv-cuda/bin/python"
_SPEC = re.compile(r"^(?:(\d+)x)?(\d+)x([A-Za-z][A-Za-z0-9]*)$")


class AotUnavailable(RuntimeError):
  """JAX's CUDA plugin is not installed in this environment (nothing to compile with)."""


def gpu_names() -> tuple[str, ...]:
  """The GPUs with a target file, by name.

  Example:
    >>> gpu_names()
    ('H100', 'H200')
  """
  return tuple(sorted(p.stem.upper() for p in TARGETS.glob("*.txtpb")))


@dataclasses.dataclass(frozen=True)
class Target:
  """``nodes`` x ``gpus_per_node`` GPUs of one kind (`gpu`, a name of `gpu_names`)."""

  nodes: int
  gpus_per_node: int
  gpu: str

  @property
  def gpus(self) -> int:
    return self.nodes * self.gpus_per_node

  def __str__(self) -> str:
    return f"{self.nodes}x{self.gpus_per_node}x{self.gpu}"


def parse_target(spec: str) -> Target:
  """``"8xH200"`` (one node of 8 GPUs) or ``"4x8xH200"`` (nodes x GPUs per node) as a `Target`.

  Example:
    >>> parse_target("4x8xh200")
    Target(nodes=4, gpus_per_node=8, gpu='H200')
    >>> parse_target("8xA100")
    Traceback (most recent call last):
    ...
    ValueError: lab.aot: unknown GPU 'A100' in '8xA100'; known: H100, H200 ...
  """
  m = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
  if m is None:
    raise ValueError(
        f"lab.aot: {spec!r} is not a target; write GPUSxNAME (one node, e.g. '8xH200') or"
        f" NODESxGPUSxNAME (e.g. '4x8xH200'), NAME one of {', '.join(gpu_names())}.")
  nodes, gpus, name = int(m.group(1) or 1), int(m.group(2)), m.group(3).upper()
  if name not in gpu_names():
    raise ValueError(
        f"lab.aot: unknown GPU {m.group(3)!r} in {spec!r}; known: {', '.join(gpu_names())}"
        f" (target files in {TARGETS}; add NAME.txtpb there for another).")
  if nodes < 1 or gpus < 1:
    raise ValueError(f"lab.aot: {spec!r} needs at least one node and one GPU per node.")
  return Target(nodes, gpus, name)


def target_config(gpu: str) -> str:
  """The text of `gpu`'s ``GpuTargetConfig`` (``lab/aot/targets/<gpu>.txtpb``).

  Example:
    >>> 'platform_name: "CUDA"' in target_config("H200")
    True
  """
  if gpu.upper() not in gpu_names():
    raise ValueError(f"lab.aot: unknown GPU {gpu!r}; known: {', '.join(gpu_names())}.")
  return (TARGETS / f"{gpu.lower()}.txtpb").read_text()


def plugin_installed() -> bool:
  """Whether JAX's CUDA plugin (``jax_plugins.xla_cuda13``) is installed: all that compiling
  for GPUs here needs.

  Example:
    >>> plugin_installed()   # the default, CPU-only venv
    False
  """
  return (importlib.util.find_spec("jax_plugins") is not None
          and importlib.util.find_spec("jax_plugins.xla_cuda13") is not None)


def _check_plugin() -> None:
  if not plugin_installed():
    raise AotUnavailable(
        "lab.aot: compiling for GPUs needs JAX's CUDA plugin (no GPU needed), which this"
        f" Python lacks; install it in a venv of its own: {INSTALL} -m lab.bench aot")


def topology(target: Target | str, *, per_process: int = 1):
  """The jax ``TopologyDescription`` of `target`: its devices, `per_process` per process.

  Example:
    >>> topo = topology("2xH200")   # needs the CUDA plugin  # doctest: +SKIP
    >>> [(d.process_index, d.device_kind) for d in topo.devices]  # doctest: +SKIP
    [(0, 'NVIDIA H200 141GB HBM3e'), (1, 'NVIDIA H200 141GB HBM3e')]
  """
  target = parse_target(target) if isinstance(target, str) else target
  if per_process < 1 or target.gpus % per_process:
    raise ValueError(f"lab.aot: per_process={per_process} must divide the {target.gpus}"
                     f" GPUs of {target}.")
  _check_plugin()
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before the plugin starts
  from jax.experimental import topologies  # noqa: PLC0415 (after the variable)

  return topologies.get_topology_desc(
      platform="cuda", target_config=target_config(target.gpu),
      topology=f"1x{target.gpus // per_process}x{per_process}")


def mesh(target: Target | str, axis_name: str = "batch", *, per_process: int = 1):
  """A one-axis `jax.sharding.Mesh` over every device of `target` (process-major).

  Example:
    >>> mesh("4x8xH200").shape  # doctest: +SKIP
    OrderedDict([('batch', 32)])
  """
  from jax.experimental import topologies  # noqa: PLC0415

  topo = topology(target, per_process=per_process)
  return topologies.make_mesh(topo, (len(topo.devices),), (axis_name,))
