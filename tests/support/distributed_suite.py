"""tests/distributed/ under an MPI launcher: the pytest command line every rank runs and the
check that every rank ran it (tests/jobs/test_mpirun.py with the mpich wheel's mpirun,
tests/jobs/test_openmpi.py with Open MPI's)."""

from __future__ import annotations

import re
import subprocess

PER_TEST_SECONDS = 180


def pytest_args(paths: tuple[str, ...] = ("tests/distributed",), select: str | None = None
                ) -> list[str]:
  """The arguments after the interpreter: ``-m pytest PATHS [-k SELECT]`` with a per-test
  timeout that ends a rank stuck in an MPI call."""
  return [
      "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider",
      *(["-k", select] if select else []),
      # A test stuck in an MPI call cannot be interrupted by a signal: the thread method
      # dumps the stacks and exits the rank, and mpirun then ends the whole job.
      f"--timeout={PER_TEST_SECONDS}", "--timeout-method=thread",
  ]


def assert_every_rank_passed(result: subprocess.CompletedProcess, ranks: int,
                             at_least: int = 10) -> None:
  """The job succeeded, each of its `ranks` printed a pytest summary and none skipped
  everything (at least `at_least` passed on every rank)."""
  assert result.returncode == 0, result.stdout[-20000:]
  summaries = re.findall(r"(\d+) passed", result.stdout)
  assert len(summaries) == ranks, result.stdout[-5000:]
  assert all(int(n) >= at_least for n in summaries), result.stdout[-5000:]
