"""The work directory as a user gets it wrong, under mpirun -n 2: two runs in one directory
(exactly one runs, the other stops at once with the lock's message on both ranks), a work
directory that is a file, one under a file and one this user may not write to. Each ends
in under 60 s (a bound against hangs, with room for a loaded machine), non-zero, with the
same message from every rank."""

import errno
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

FLAGS = ["--epochs", "2", "--no-progress"]
IN_USE = "is in use by another run: pid"
# The digits train in about a second: slowed to 0.2 s a step (44 steps), the first run still
# holds the directory when the second one, started with it, reaches the training loop.
SLOW = ["tests/support/slow_train.py", "0.2"]


def timed_run(workdir, timeout=300, script=("experiments/train.py",)):
  start = time.monotonic()
  result = run_mpi(2, [*script, *FLAGS, "--workdir", str(workdir)], timeout=timeout)
  return result, time.monotonic() - start


def epochs(workdir):
  return [json.loads(line)["epoch"]
          for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_two_runs_started_together_in_one_workdir_one_runs(tmp_path):
  with ThreadPoolExecutor(2) as pool:
    runs = list(pool.map(lambda _: timed_run(tmp_path, script=SLOW), range(2)))
  winners = [r for r, _ in runs if r.returncode == 0]
  losers = [(r, seconds) for r, seconds in runs if r.returncode != 0]
  assert len(winners) == 1 and len(losers) == 1, [r.stdout[-3000:] for r, _ in runs]
  (loser, seconds), = losers
  # Both ranks of the loser say why (the failfast hook prefixes every line with the rank).
  for rank in (0, 1):
    assert f"[rank {rank}] RuntimeError: mnjax: the work directory" in loser.stdout, loser.stdout
  assert loser.stdout.count(IN_USE) >= 2 and "Fix: wait for that run to end" in loser.stdout
  assert seconds < 60, seconds
  assert epochs(tmp_path) == [1, 2]  # one run's records, not two interleaved
  assert not (tmp_path / "mnjax.lock").exists()  # released at the end
  assert (tmp_path / "params.npz").exists()


def test_a_run_started_while_another_holds_the_workdir_stops_at_once(tmp_path):
  with ThreadPoolExecutor(1) as pool:
    first = pool.submit(timed_run, tmp_path, script=SLOW)
    deadline = time.monotonic() + 120
    while not (tmp_path / "mnjax.lock").exists():
      assert time.monotonic() < deadline and not first.done(), "the first run took no lock"
      time.sleep(0.05)
    second, seconds = timed_run(tmp_path)
    result, _ = first.result()
  assert result.returncode == 0, result.stdout[-5000:]
  assert second.returncode != 0 and second.stdout.count(IN_USE) >= 2, second.stdout[-5000:]
  assert seconds < 60, seconds
  assert epochs(tmp_path) == [1, 2]


def check_refused(workdir, *expected):
  result, seconds = timed_run(workdir, timeout=120)
  assert result.returncode != 0, result.stdout[-5000:]
  for rank in (0, 1):
    assert f"[rank {rank}] RuntimeError: mnjax: could not" in result.stdout, result.stdout[-5000:]
  for text in expected:
    assert result.stdout.count(text) >= 2, (text, result.stdout[-5000:])
  assert "[failed on ranks [0] of 2]" in result.stdout
  assert seconds < 60, seconds


def test_a_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "run"
  path.write_text("not a directory")
  check_refused(path, "is a file, not a directory: pass a --workdir")


def test_a_workdir_under_a_file(tmp_path):
  # What fails for root too (this suite often runs as root, where chmod stops nothing).
  (tmp_path / "file").write_text("")
  check_refused(tmp_path / "file" / "run", "Not a directory", "a parent of")


def test_a_workdir_this_user_may_not_write(tmp_path):
  if os.geteuid() != 0:
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    path = parent / "run"
  else:  # root writes through any mode bits; sysfs refuses new directories even to root
    probe = "/sys/mnjax-read-only-test"
    try:
      os.mkdir(probe)
    except OSError as error:
      if error.errno not in (errno.EPERM, errno.EACCES, errno.EROFS):
        pytest.skip(f"mkdir {probe}: {error}")
    else:
      os.rmdir(probe)
      pytest.skip("found no directory that root may not write to")
    path = f"{probe}/run"
  check_refused(path, "this process may not write there")


def test_a_killed_run_leaves_a_stale_lock_the_next_run_takes_over(tmp_path):
  killed = run_mpi(2, ["tests/support/killed_train.py", "1", "5", *FLAGS, "--workdir",
                       str(tmp_path)], timeout=120)
  assert killed.returncode != 0
  pid = json.loads((tmp_path / "mnjax.lock").read_text())["pid"]  # left behind
  result = run_mpi(2, ["experiments/train.py", *FLAGS, "--workdir", str(tmp_path), "--resume"],
                   timeout=120)
  assert result.returncode == 0, result.stdout[-5000:]
  assert f"mnjax: took over the stale lock of pid {pid} on host" in result.stdout
  assert not (tmp_path / "mnjax.lock").exists()
