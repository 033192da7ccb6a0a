"""One rank fails, the whole job ends, quickly, saying which rank (tests/faults/fault_job.py).

Each job runs under mpirun with a hard timeout; the watchdog in the job uses 3 s timeouts.
``-disable-auto-cleanup`` makes MPICH's launcher leave the surviving ranks running when one
dies (as ``srun`` without ``--kill-on-bad-exit`` does), so only mnjax can end those jobs.
"""

import re
import time

import numpy as np
import pytest

from launch import run_mpi
from mnjax.guard._watchdog import _JobView

KEEP_RUNNING = ("-disable-auto-cleanup",)


def run_fault(mode, mpi_args=()):
  start = time.monotonic()
  result = run_mpi(2, ["tests/faults/fault_job.py", mode], timeout=60, mpi_args=mpi_args)
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


def message(step, entered, completed, done=False):
  return np.array([step, int(done), entered, completed])


def test_job_view_reports_late_silent_and_blocked_ranks():
  # Rank 0's bookkeeping on its own, for four ranks, with a 10 s timeout.
  view = _JobView(4, now=0.0)
  for rank in range(4):
    view.update(rank, message(5, 10, 10), now=1.0)
  assert view.stall_report(5.0, timeout=10, heartbeat_timeout=10) == ""
  # Ranks 0 and 1 go on to step 7 (no mnjax collectives: e.g. on GPU); rank 2 stays at 5.
  for rank in (0, 1):
    view.update(rank, message(7, 0, 0), now=2.0)
  view.update(2, message(5, 0, 0), now=11.5)
  view.update(3, message(7, 0, 0, done=True), now=11.5)  # finished: never reported
  for rank in (0, 1):
    view.update(rank, message(7, 0, 0), now=11.5)
  assert view.stall_report(11.5, timeout=10, heartbeat_timeout=10) == ""  # 9.5 s: not yet
  report = view.stall_report(12.5, timeout=10, heartbeat_timeout=10)
  assert "rank 2 has not reached step 6 10 s after the first rank did (the furthest is at step 7)" in report
  assert "rank 3" not in report and "rank 1 " not in report
  # Ranks 1 and 2 fall silent (rank 0, the monitor, updates itself on every round).
  view.update(0, message(7, 0, 0), now=22.0)
  report = view.stall_report(22.0, timeout=100, heartbeat_timeout=10)
  assert "no message from rank 1 (at step 7) for 10 s, rank 2 (at step 5) for 10 s" in report


def test_job_view_names_ranks_that_never_entered_the_collective():
  view = _JobView(3, now=0.0)
  view.update(0, message(4, 9, 8), now=1.0)  # waits in collective #9
  view.update(1, message(4, 9, 8), now=1.0)
  view.update(2, message(3, 8, 8), now=1.0)  # never came
  for now in (5.0, 10.0, 11.5):
    for rank, m in enumerate([message(4, 9, 8), message(4, 9, 8), message(3, 8, 8)]):
      view.update(rank, m, now=now)
  assert view.stall_report(10.5, timeout=10, heartbeat_timeout=60) == ""
  report = view.stall_report(11.5, timeout=10, heartbeat_timeout=60)
  assert ("ranks [0, 1] have waited over 10 s in in-step collective #9 (at step 4); rank 2 has"
          " not entered it (at step 3, after 8 collectives)") in report
  assert "has not reached step" not in report  # rank 2 is reported once, as absent
