"""mpi4jax on GPUs: its CUDA extension and an explicit copy mode (docs/design/gpu.md); left to
mpi4jax, a warnings-as-errors run would leave it unset and segfault. Not needed by ``xla``."""

from __future__ import annotations

import ctypes
import os

from mnjax.comm._instep import _compat as compat

__all__ = ["ENV", "configure", "mpi_reports_cuda"]

#: mpi4jax's switch: "1" device pointers to a CUDA-aware MPI, "0" copy through host memory.
ENV = "MPI4JAX_USE_CUDA_MPI"
_TRUE, _FALSE = ("1", "true", "on"), ("0", "false", "off")
_configured: bool | None = None


def configure(environ=os.environ) -> bool:
  """Checks mpi4jax's CUDA extension and sets its copy mode; returns True for CUDA-aware MPI.

  Idempotent. Raises `RuntimeError` (with the fix) when the extension did not load, or
  ``MPI4JAX_USE_CUDA_MPI`` is unset, not a boolean, or ``1`` on an MPI that is not CUDA-aware.

  Example:
    >>> os.environ["MPI4JAX_USE_CUDA_MPI"] = "0"  # mpich wheel: via the host  # doctest: +SKIP
    >>> configure()                               # on a GPU machine  # doctest: +SKIP
    False
  """
  global _configured
  if _configured is not None:
    return _configured
  import mpi4jax  # noqa: PLC0415

  if not mpi4jax.has_cuda_support():
    raise RuntimeError(
        "mnjax: mpi4jax's CUDA extension is not installed or did not load, so the MPI"
        " communicator kinds cannot run on GPUs. Rebuild it: MNJAX_EXTRAS=cuda"
        " scripts/setup.sh (it rebuilds mpi4jax against the CUDA toolkit it finds; set"
        " CUDA_ROOT to the toolkit folder whose include/ holds cuda_runtime.h). Or use"
        " kind 'xla' (NCCL), the fast path on GPUs."
    )
  value = environ.get(ENV, "").strip().lower()
  if value not in _TRUE + _FALSE:
    raise RuntimeError(
        f"mnjax: set {ENV} before running the MPI kinds on GPUs (got {value!r}): 0 copies"
        " every buffer through host memory around the MPI call (works with every MPI,"
        " including the mpich wheel scripts/setup.sh installs; scripts/activate.sh sets"
        " it), 1 hands device pointers to MPI (only with a CUDA-aware MPI, e.g. a cluster's"
        " Open MPI built with CUDA). Or use kind 'xla' (NCCL), the fast path on GPUs."
    )
  cuda_aware = value in _TRUE
  if cuda_aware and mpi_reports_cuda() is False:
    raise RuntimeError(
        f"mnjax: {ENV}=1 asks mpi4jax to hand device pointers to MPI, but this MPI library"
        " reports no CUDA support (it would segfault on the first collective). Set"
        f" {ENV}=0 (copy through host memory), or build against a CUDA-aware MPI"
        " (MNJAX_MPI=system scripts/setup.sh with the cluster's CUDA-aware MPI on PATH)."
    )
  compat.set_mpi4jax_cuda_copy_mode(copy_to_host=not cuda_aware)  # mnjax decided, not mpi4jax
  _configured = cuda_aware
  return cuda_aware


def mpi_reports_cuda() -> bool | None:
  """Whether the loaded MPI library says it is CUDA-aware; None when it cannot tell.

  Example:
    >>> mpi_reports_cuda()     # the mpich wheel
    False
  """
  from mpi4py import MPI  # noqa: F401,PLC0415 (loads libmpi)

  with open("/proc/self/maps") as maps:
    paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line})
  for path in paths:
    try:
      lib = ctypes.CDLL(path)
    except OSError:
      continue
    if hasattr(lib, "MPIX_GPU_query_support"):
      supported = ctypes.c_int(0)
      if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:  # 0: CUDA
        return bool(supported.value)
    if hasattr(lib, "MPIX_Query_cuda_support"):
      return bool(lib.MPIX_Query_cuda_support())
  return None
