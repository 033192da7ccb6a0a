"""The launcher started N processes but MPI sees one (launcher and MPI speak different PMIs,
e.g. ``srun --mpi=none``): `check_world` raises instead of letting each train alone."""

from __future__ import annotations

import os

__all__ = ["check_world", "launched_size"]

#: Where launchers put their process count, most specific first (Open MPI, PMI, Slurm step).
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


def launched_size(environ=os.environ) -> tuple[str, int] | None:
  """``(variable, processes)`` of the launcher that started this process, or None.

  Example:
    >>> launched_size({"SLURM_STEP_NUM_TASKS": "4"})
    ('SLURM_STEP_NUM_TASKS', 4)
  """
  for name in SIZE_VARIABLES:
    value = environ.get(name, "")
    if value.isdigit():
      return name, int(value)
  return None


def check_world(world_size: int, library: str, environ=os.environ) -> None:
  """Raises `RuntimeError` when a launcher started several processes but MPI's world has one.

  Example:
    >>> check_world(4, "MPICH", {"PMI_SIZE": "4"})   # fine: MPI sees the launcher's job
    >>> check_world(1, "MPICH", {"SLURM_STEP_NUM_TASKS": "4"})
    Traceback (most recent call last):
    ...
    RuntimeError: create_communicator: the launcher started 4 processes ...
  """
  found = launched_size(environ)
  if world_size != 1 or found is None or found[1] <= 1:
    return
  name, size = found
  mpi = library.strip().splitlines()[0] if library.strip() else "this MPI"
  raise RuntimeError(
      f"create_communicator: the launcher started {size} processes ({name}={size}), but MPI"
      f" sees 1: each process is its own MPI job (a singleton) and would train alone. The"
      f" launcher does not speak the PMI of the MPI that mpi4py loaded ({mpi}). Under Slurm:"
      " srun --mpi=pmi2 for the mpich wheel (scripts/slurm.sh sets MpiDefault=pmi2; srun"
      " --mpi=list shows what the cluster offers), not --mpi=none; under mpirun: the mpirun"
      " of the venv's own MPI (.venv/bin/mpirun for the mpich wheel). Independent"
      " single-process runs: start each with srun -n 1.")
