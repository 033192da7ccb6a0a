"""The watchdog's bookkeeping (rank 0's view of the job), without processes: who is late, who
is silent, who never entered the collective the others wait in. The watchdog in running jobs is
tested by tests/jobs/test_fault_job.py."""

import numpy as np

from mnjax.guard._watchdog import _JobView


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
  assert ("rank 2 has not reached step 6 10 s after the first rank did (the furthest is at"
          " step 7)") in report
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


def test_job_view_names_a_finished_rank_the_others_wait_for():
  view = _JobView(3, now=0.0)
  view.update(2, message(6, 7, 7, done=True), now=1.0)  # finished after 7 collectives
  for now in (1.0, 3.0, 6.5):
    view.update(0, message(7, 8, 7), now=now)  # waits in #8, which rank 2 never entered
    view.update(1, message(7, 8, 8), now=now)  # between collectives: fine
  assert view.stall_report(5.5, timeout=100, heartbeat_timeout=60) == ""  # within the grace
  report = view.stall_report(6.5, timeout=100, heartbeat_timeout=60)
  assert report.startswith(
      "mnjax watchdog: rank 2 finished (after step 6 and 7 in-step collectives) while rank 0"
      " has waited 6 s in in-step collective #8 (at step 7), which rank 2 never entered.")
  assert "rank 1" not in report
  # The same wait for a collective the finished rank did enter is left to the timeout.
  view = _JobView(2, now=0.0)
  view.update(1, message(6, 8, 8, done=True), now=1.0)
  view.update(0, message(7, 8, 7), now=1.0)
  assert view.stall_report(50.0, timeout=100, heartbeat_timeout=60) == ""


def test_without_collective_counters_a_finished_rank_behind_is_named_after_the_timeout():
  view = _JobView(2, now=0.0)  # GPU handlers: no counters, only steps
  view.update(1, message(6, 0, 0, done=True), now=1.0)
  view.update(0, message(7, 0, 0), now=2.0)
  view.update(0, message(7, 0, 0), now=11.0)
  assert view.stall_report(11.0, timeout=10, heartbeat_timeout=60) == ""
  view.update(0, message(7, 0, 0), now=12.5)
  assert "rank 1 finished after step 6 while rank 0 is at step 7 and has not moved for" in (
      view.stall_report(12.5, timeout=10, heartbeat_timeout=60))
