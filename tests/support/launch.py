"""Run a command under mpirun with a hard timeout, so that a hang becomes a test failure."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: XLA's flag that lowers the backend's (LLVM's) optimisation level: 24-41% less CPU for a
#: launch that mostly compiles (many programs, a few steps each), 27% less for a 2-epoch
#: digits job (measured in docs/testing.md). tests/conftest.py adds it to the ``XLA_FLAGS``
#: every process of the suite inherits, so every launch compiles alike (it changes the last
#: bits of a trained model: launches compared bitwise must share it). tests/aot drops it.
COMPILE_FAST = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
  """``XLA_FLAGS`` for a launch with its own number of emulated CPU devices, compiled as
  every other launch (`COMPILE_FAST`)."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FAST}"


def mpirun_path() -> str:
  """The mpirun next to this interpreter (the venv's MPICH), else the one on PATH."""
  here = Path(sys.executable).parent / "mpirun"
  found = str(here) if here.exists() else shutil.which("mpirun")
  if found is None:
    raise RuntimeError("no mpirun: run the tests through scripts/test.sh (it installs MPICH)")
  return found


def run_mpi(ranks: int, args: list[str], *, timeout: float, env: dict | None = None,
            mpi_args: tuple[str, ...] = (), mpirun: str | None = None,
            python: str | None = None):
  """Runs ``mpirun [mpi_args] -n ranks <python> args``; kills the whole job after `timeout` s.

  `mpirun` and `python` default to `mpirun_path()` and this interpreter (another MPI's
  launcher and venv: tests/jobs/test_openmpi.py). Returns the `subprocess.CompletedProcess`
  (stdout and stderr merged, as text). A job that does not finish in time raises
  `AssertionError` with the output so far.
  """
  cmd = [mpirun or mpirun_path(), *mpi_args, "-n", str(ranks), python or sys.executable, *args]
  full_env = {**os.environ, **(env or {})}
  proc = subprocess.Popen(
      cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True,
  )
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    raise AssertionError(
        f"{' '.join(cmd)} did not finish within {timeout:.0f} s (hang?). Output:\n{out}"
    ) from None
  return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
