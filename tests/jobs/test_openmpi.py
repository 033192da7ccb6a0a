"""A cluster MPI: the venv that ``MNJAX_MPI=system MNJAX_VENV=DIR scripts/setup.sh`` builds
against Debian's OpenMPI (mpi4py and mpi4jax from source with its mpicc) loads only Open
MPI's libmpi; under OpenMPI's ``mpirun -n 2`` the main job ends with the parameters of the
same job under the mpich wheel's mpirun, a subset of tests/distributed passes, and the
places where the two MPIs differ behave as under MPICH (tests/jobs/test_fault_job.py): an
uncaught exception's ``MPI_Abort``, the watchdog's thread (``MPI_THREAD_MULTIPLE``), the
departure notices at exit, MPI errors as exceptions (``MPI_ERRORS_RETURN``), and a launcher
of the other MPI (singletons) refused. The venv: ``$MNJAX_OPENMPI_VENV`` (default
``<repo>/.venv-openmpi``); skipped where it has not been built
(scripts/ci_cluster_launchers.sh builds it)."""

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.distributed_suite import assert_every_rank_passed, pytest_args
from support.fault_job import early_finish_named
from support.launch import REPO, run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

VENV = Path(os.environ.get("MNJAX_OPENMPI_VENV", REPO / ".venv-openmpi"))
FLAGS = ["--epochs", "3", "--no-progress"]
# The containers here refuse cross-memory attach (ptrace): vader copies through shm.
OMPI_ENV = {"OMPI_MCA_btl_vader_single_copy_mechanism": "none", "VIRTUAL_ENV": str(VENV)}

LOADED = """
import sys, mpi4jax, mnjax
from mpi4py import MPI
comm = mnjax.create_communicator("flat")
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libmpi" in line})
lines = [MPI.Get_library_version().strip(chr(0)).splitlines()[0], *maps,
         f"THREAD_MULTIPLE {MPI.Query_thread() == MPI.THREAD_MULTIPLE}"]
try:  # an MPI error is a Python exception (ERRORS_RETURN), with the standard error class
  comm.mpi_comm.Send(b"x", dest=comm.size + 5)
except MPI.Exception as e:
  lines.append(f"ERR_RANK {e.Get_error_class() == MPI.ERR_RANK}")
sys.stdout.write("\\n".join(lines) + "\\n"); sys.stdout.flush()  # one write: not interleaved
"""

# tests/distributed under Open MPI: the files that call MPI themselves (collectives, host
# collectives, the communicator and its kinds, errors and agreement, the wire, the
# coordinator of kind xla, checkpoints), without the single_node and two_dimensional
# variants (the same MPI calls as hierarchical, 20 s more); ~70 s on 2 idle cores.
OPENMPI_SUITE = tuple(f"tests/distributed/test_{name}.py" for name in (
    "collectives", "host_collectives", "communicator", "errors", "agreement", "consensus",
    "wire", "coordinator", "host", "scatter_root", "preflight", "split", "checkpointer"))
OPENMPI_SELECT = "not single_node and not two_dimensional"


def ompi_mpirun():
  """OpenMPI's mpirun (its own name: orterun), or None."""
  for name in ("orterun", "mpirun.openmpi"):
    found = shutil.which(name)
    if found:
      return found
  return None


@pytest.fixture(scope="module")
def venv():
  if not (VENV / "bin" / "python").exists() or ompi_mpirun() is None:
    pytest.skip(f"no OpenMPI venv at {VENV} (MNJAX_OPENMPI_VENV) or no OpenMPI mpirun: build it"
                " with Debian's openmpi-bin/libopenmpi-dev installed and MNJAX_MPI=system"
                f" MNJAX_VENV={VENV} scripts/setup.sh")
  return VENV


def run_openmpi(venv, args, timeout, python=None):
  """``mpirun -n 2`` of Open MPI (as root, 2 ranks on however many cores) -> the result."""
  return run_mpi(2, args, timeout=timeout, env=OMPI_ENV, mpirun=ompi_mpirun(),
                 python=python or str(venv / "bin" / "python"),
                 mpi_args=("--allow-run-as-root", "--oversubscribe"))


def test_the_venv_runs_on_open_mpi_only(venv):
  out = run_openmpi(venv, ["-c", LOADED], timeout=180)
  assert out.returncode == 0, out.stdout[-3000:]
  lines = out.stdout.splitlines()
  assert lines.count(next(x for x in lines if x.startswith("Open MPI"))) == 2, out.stdout
  libs = {x for x in lines if "libmpi" in x}
  # Open MPI's soname is libmpi.so.40; MPICH's (the wheel's) libmpi.so.12 must not be mapped.
  assert libs and all("libmpi.so.40" in x for x in libs), libs
  assert lines.count("THREAD_MULTIPLE True") == 2 and lines.count("ERR_RANK True") == 2, lines


def test_main_job_under_open_mpi_equals_the_mpich_run(venv, tmp_path):
  ompi, mpich = tmp_path / "openmpi", tmp_path / "mpich"
  out = run_openmpi(venv, ["experiments/train.py", *FLAGS, "--workdir", str(ompi)], 300)
  assert out.returncode == 0, out.stdout[-5000:]
  assert "2 rank(s)" in out.stdout and "final test accuracy" in out.stdout
  result = run_mpi(2, ["experiments/train.py", *FLAGS, "--workdir", str(mpich)], timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  # Same jax/jaxlib, same programs; a sum of two float32 does not depend on the MPI.
  a, b = np.load(ompi / "params.npz"), np.load(mpich / "params.npz")
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_distributed_tests_pass_under_open_mpi(venv):
  result = run_openmpi(venv, pytest_args(OPENMPI_SUITE, OPENMPI_SELECT), timeout=600)
  assert_every_rank_passed(result, 2, at_least=100)


def run_fault(venv, mode):
  start = time.monotonic()
  result = run_openmpi(venv, ["tests/support/fault_job.py", mode], timeout=60)
  return result, time.monotonic() - start


def test_an_exception_on_one_rank_aborts_every_rank_under_open_mpi(venv):
  # Open MPI's MPI_Abort: its mpirun kills the other rank and exits non-zero.
  result, seconds = run_fault(venv, "raise")
  assert result.returncode != 0 and seconds < 30, result.stdout
  assert "[rank 1] RuntimeError: injected failure on rank 1" in result.stdout
  assert "mnjax: rank 1 of 2 failed with RuntimeError; aborting all ranks" in result.stdout
  assert "finished" not in result.stdout


def test_the_watchdog_names_a_stall_under_open_mpi(venv):
  # The watchdog's thread calls MPI beside the main thread (MPI_THREAD_MULTIPLE) and aborts.
  result, seconds = run_fault(venv, "stall")
  assert result.returncode != 0 and seconds < 30, result.stdout  # rank 1 sleeps 120 s
  assert ("ranks [0] have waited over 3 s in in-step collective #4 (at step 3); rank 1 has"
          " not entered it (at step 3, after 3 collectives)") in result.stdout


def test_a_rank_that_finishes_early_is_named_under_open_mpi(venv):
  # The departure notices at exit (mnjax.comm._departures) on Open MPI's point-to-point, seen
  # by the in-step allreduce's progress thread or the watchdog.
  result, seconds = run_fault(venv, "worker_short")
  assert result.returncode != 0 and seconds < 30, result.stdout
  assert early_finish_named(result.stdout, 1, 0), result.stdout


SINGLETON = "the launcher started 2 processes ({}=2), but MPI sees 1"


def test_open_mpis_mpirun_of_the_mpich_venv_fails_in_mpi_init(venv):
  # MPICH finds Open MPI's PMIx in its environment and refuses it itself, before mnjax runs
  # (no singletons here); the job fails rather than training twice alone.
  result = run_openmpi(venv, ["-c", "import mnjax; mnjax.create_communicator('flat')"],
                       timeout=120, python=sys.executable)
  assert result.returncode != 0
  assert "Runtime environment uses unsupported PMI version PMIx" in result.stdout, result.stdout


def test_the_mpich_mpirun_of_the_open_mpi_venv_is_refused_on_every_process(venv):
  result = run_mpi(2, ["-c", "import mnjax; mnjax.create_communicator('flat')"], timeout=120,
                   python=str(venv / "bin" / "python"), env=OMPI_ENV)
  assert result.returncode != 0
  assert result.stdout.count(SINGLETON.format("PMI_SIZE")) == 2, result.stdout
