"""Shared fixtures. The same tests run in one process (size 1) and under mpirun.

`tests/jobs/test_mpirun.py` re-runs everything in `tests/distributed/` under `mpirun -n 2` and
`-n 3`; assertions there are written in terms of `comm.size`.
"""

import os
import shutil
import tempfile
from pathlib import Path

from support.launch import COMPILE_FAST

# Before jax is imported: two CPU devices per process (so the multi-device kinds run as
# 1 x 2 here and as 2 x 2 under tests/jobs/test_mpirun.py), quiet logs. `flat` uses the first
# device only. Every process the suite launches inherits these flags, LLVM's optimisations
# off among them (`support.launch.COMPILE_FAST`: its jobs and benchmarks mostly compile).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
if COMPILE_FAST not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += f" {COMPILE_FAST}"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One persistent compilation cache for the whole run, inherited by every mpirun job it
# launches: the ResNet jobs compile the same steps several times (start, resume).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the outermost session makes it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mnjax-jax-cache-")
# MPICH's waits spin a core; on a machine the suite oversubscribes (two workers, each with its
# ranks), a rank spinning in a collective takes the core its peer needs. Yielding inside the
# wait: the `-n 2` suite beside a busy core 95 s -> 86 s, alone unchanged (45-48 s).
os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
# lab/ is not installed: every process a test starts imports it from the checkout.
_REPO = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

import jax
import pytest
from support.shm import remove_orphaned_segments

import mnjax

# This process compiles thousands of small programs and runs each a few times: JAX's option
# that turns off most of XLA's optimisations, beyond the backend's: the fast subset
# 141 -> 117 core-s, 82 -> 65 s. tests/aot turns it back off (its schedules are the point).
jax.config.update("jax_disable_most_optimizations", True)

# Every process a test starts keeps all its compiled programs in that cache, not only those
# that took over a second (jax's default): the job tests launch the same experiment many
# times (run, kill, resume) and each launch then skips its compiles (13.7 s -> 5.9 s for one
# digits epoch under mpirun -n 2). Set after jax is imported, so this process, whose
# thousands of small test programs are compiled once each, does not write them all.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _mpi_rank() -> str | None:
  """This process's rank when an MPI launcher started it (MPICH/Hydra, Open MPI, Slurm)."""
  for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
    if name in os.environ:
      return os.environ[name]
  return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  # Under mpirun every rank is its own pytest session, and by default all of them share
  # /tmp/pytest-of-<user>/: at the end each rank prunes the old numbered directories there
  # and they race (one rank fails with "Directory not empty"). Each rank gets its own base.
  rank = _mpi_rank()
  if rank is not None and config.option.basetemp is None:
    config.option.basetemp = tempfile.mkdtemp(prefix=f"pytest-rank{rank}-")
    config._mnjax_rank_basetemp = config.option.basetemp


# The test files that run longest (a few minutes of jobs each, measured), first: under
# scripts/test.sh's two workers, files are dealt out in collection order, and a long file
# dealt last would run alone at the end.
LONGEST_FIRST = tuple(f"tests/jobs/{name}.py" for name in (
    "test_mpirun", "test_bench", "test_resume", "test_main_job", "test_imagenet_job",
    "test_workdir_jobs", "test_checkpoint_kill", "test_multi_node_model", "test_xla"))


def pytest_collection_modifyitems(config, items):
  if not hasattr(config, "workerinput"):  # not an xdist worker: the files in their own order
    return  # (run first, the mpirun suite would share the cores with CI's background set-ups)
  order = {path: i for i, path in enumerate(LONGEST_FIRST)}
  root = Path(str(config.rootpath))
  items.sort(key=lambda item: order.get(item.path.relative_to(root).as_posix(),
                                        len(LONGEST_FIRST)))


def pytest_runtest_teardown(item):
  # The job tests kill ranks on purpose; what MPICH leaves in /dev/shm then goes with them.
  if _mpi_rank() is None and "jobs" in item.path.parts:
    remove_orphaned_segments()


def pytest_unconfigure(config):
  base = getattr(config, "_mnjax_rank_basetemp", None)
  if base is not None:
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def comm() -> mnjax.Communicator:
  """The flat communicator over every process of this test run (COMM_WORLD)."""
  return mnjax.create_communicator("flat")
