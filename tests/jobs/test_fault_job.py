"""One rank fails, the whole job ends, quickly, saying which rank (tests/support/fault_job.py):
mnjax.comm's abort on error, and mnjax.Watchdog for ranks that stop or stall.

Each job runs under mpirun with a hard timeout; the watchdog in the job uses 3 s timeouts.
``-disable-auto-cleanup`` makes MPICH's launcher leave the surviving ranks running when one
dies (as ``srun`` without ``--kill-on-bad-exit`` does), so only mnjax can end those jobs.
"""

import re
import time

import pytest
from support.fault_job import early_finish_named
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

KEEP_RUNNING = ("-disable-auto-cleanup",)


def run_fault(mode, mpi_args=()):
  start = time.monotonic()
  result = run_mpi(2, ["tests/support/fault_job.py", mode], timeout=60, mpi_args=mpi_args)
  return result, time.monotonic() - start


def test_exception_on_rank_1_aborts_every_rank():
  result, seconds = run_fault("raise")
  assert result.returncode != 0, result.stdout
  assert seconds < 30
  assert "[rank 1] RuntimeError: injected failure on rank 1" in result.stdout
  assert "mnjax: rank 1 of 2 failed with RuntimeError; aborting all ranks" in result.stdout
  assert "finished" not in result.stdout


@pytest.mark.parametrize("mpi_args", [(), KEEP_RUNNING], ids=["mpirun", "no-auto-cleanup"])
def test_sigkill_of_rank_1_ends_the_job(mpi_args):
  result, seconds = run_fault("kill", mpi_args)
  assert result.returncode != 0, result.stdout
  assert seconds < 30
  assert "finished" not in result.stdout


@pytest.mark.parametrize("mpi_args", [(), KEEP_RUNNING], ids=["mpirun", "no-auto-cleanup"])
def test_sigkill_of_rank_0_ends_the_job(mpi_args):
  result, seconds = run_fault("kill_root", mpi_args)
  assert result.returncode != 0, result.stdout
  assert seconds < 30
  assert "finished" not in result.stdout


def test_a_silent_rank_0_is_noticed_by_the_others():
  # Rank 0 stops (SIGSTOP): alive, so no launcher ends the job; rank 1's watchdog must.
  result, seconds = run_fault("stop_root", KEEP_RUNNING)
  assert result.returncode != 0, result.stdout
  assert seconds < 30
  assert re.search(r"mnjax watchdog: rank 1 has not heard from rank 0 for \d+ s \(this rank is"
                   r" at step 3\); rank 0 died", result.stdout), result.stdout


def test_stall_names_the_missing_rank_and_its_step():
  result, seconds = run_fault("stall", KEEP_RUNNING)
  assert result.returncode != 0, result.stdout
  assert seconds < 30  # rank 1 sleeps 120 s: the watchdog ended the job
  assert ("ranks [0] have waited over 3 s in in-step collective #4 (at step 3); rank 1 has"
          " not entered it (at step 3, after 3 collectives)") in result.stdout


@pytest.mark.parametrize("mode", ["root_lingers", "worker_lingers"])
def test_ranks_that_finish_apart_are_not_a_stall(mode):
  result, _ = run_fault(mode)
  assert result.returncode == 0, result.stdout
  assert result.stdout.count("finished") == 2


@pytest.mark.parametrize("mode, short, waiting", [("worker_short", 1, 0), ("root_short", 0, 1)])
def test_a_rank_that_finishes_early_is_named_not_waited_for(mode, short, waiting):
  result, seconds = run_fault(mode)
  assert result.returncode != 0, result.stdout
  assert seconds < 30, result.stdout
  assert early_finish_named(result.stdout, short, waiting), result.stdout
