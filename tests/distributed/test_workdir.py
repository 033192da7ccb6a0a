"""The work directory: one run at a time (`WorkdirLock`), and a failed write there ends
the job with the same message on every rank (config.json, metrics.jsonl, params.npz)."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from lab.runner import MetricsLog, RunConfig, WorkdirLock, save_params, train_loop, write_config

LOCK = "mnjax.lock"


@pytest.fixture(autouse=True)
def collectives_still_line_up(comm):
  """After each error every rank must still be in step (else this allreduce times out)."""
  yield
  assert comm.mpi_comm.allreduce(1) == comm.size


@pytest.fixture
def shared(comm, tmp_path):
  """One directory for every rank (each pytest rank has its own tmp_path): rank 0's."""
  return comm.mpi_comm.bcast(str(tmp_path), root=0)


def raises_everywhere(comm, match, fn, *args, **kwargs) -> str:
  """`fn` raises `RuntimeError` matching `match`, with the same message on every rank."""
  with pytest.raises(RuntimeError, match=match) as error:
    fn(*args, **kwargs)
  messages = comm.mpi_comm.allgather(str(error.value))
  assert messages == [messages[0]] * comm.size
  return messages[0]


def plant_lock(comm, workdir, **holder):
  """Rank 0 writes a lock as another run would have left it."""
  if comm.is_root:
    os.makedirs(workdir, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getppid(), "started": time.time(),
            "ranks": 2, "kind": "flat", "command": "experiments/train.py --workdir x"}
    with open(os.path.join(workdir, LOCK), "w") as f:
      json.dump({**base, **holder}, f)
  comm.mpi_comm.Barrier()


def dead_pid() -> int:
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def test_the_lock_names_its_holder_and_is_released(comm, shared):
  with WorkdirLock(shared, comm) as lock:
    assert lock.held and lock.took_over is None
    if comm.is_root:
      with open(os.path.join(shared, LOCK)) as f:
        holder = json.load(f)
      assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
      assert holder["ranks"] == comm.size and holder["started"] <= time.time()
    comm.mpi_comm.Barrier()
  assert not lock.held
  comm.mpi_comm.Barrier()  # release is rank 0's alone
  assert not os.path.exists(os.path.join(shared, LOCK))


def test_the_lock_is_released_when_the_run_raises(comm, shared):
  with pytest.raises(ZeroDivisionError), WorkdirLock(shared, comm):
    _ = 1 / 0
  comm.mpi_comm.Barrier()
  assert not os.path.exists(os.path.join(shared, LOCK))


def test_a_second_run_is_refused_on_every_rank_before_anything_is_written(comm, shared):
  plant_lock(comm, shared)
  config = RunConfig(epochs=1, global_batch_size=comm.size, workdir=shared, progress=False)
  message = raises_everywhere(
      comm, r"work directory .* is in use by another run: pid \d+ on host .*started .*\(2 ranks:"
            r" experiments/train.py --workdir x\); that process is still running.*Fix: wait",
      train_loop, config, comm, None, None, None, steps_per_epoch=1)
  assert f"delete {os.path.join(shared, LOCK)}" in message
  assert "[failed on ranks [0] of" in message
  assert sorted(os.listdir(shared)) == [LOCK]  # no config.json, no checkpoints/
  with open(os.path.join(shared, LOCK)) as f:
    assert json.load(f)["pid"] == os.getppid()  # the holder's lock is left alone


def test_a_lock_from_another_host_is_not_broken(comm, shared):
  plant_lock(comm, shared, host="elsewhere.example", pid=dead_pid())
  raises_everywhere(comm, r"on host 'elsewhere.example'.*cannot tell from this host whether it"
                    r" still runs.*if it is no longer running, delete", WorkdirLock(shared, comm)
                    .acquire)


def test_a_stale_lock_is_taken_over_with_a_note(comm, shared, capsys):
  gone = dead_pid()
  plant_lock(comm, shared, pid=gone)
  with WorkdirLock(shared, comm) as lock:
    if comm.is_root:
      assert lock.took_over["pid"] == gone
      with open(os.path.join(shared, LOCK)) as f:
        assert json.load(f)["pid"] == os.getpid()
      assert f"took over the stale lock of pid {gone}" in capsys.readouterr().out
  comm.mpi_comm.Barrier()
  assert not os.path.exists(os.path.join(shared, LOCK))


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_reused_pid_does_not_keep_a_stale_lock(comm, shared):
  # The pid is alive, but its process started at another time than the lock says.
  plant_lock(comm, shared, process_start="1")
  with WorkdirLock(shared, comm) as lock:
    assert lock.took_over["pid"] == os.getppid() if comm.is_root else lock.took_over is None


def test_a_workdir_that_is_a_file(comm, shared):
  path = os.path.join(shared, "file")
  if comm.is_root:
    open(path, "w").close()
  comm.mpi_comm.Barrier()
  raises_everywhere(comm, r"could not open the work directory .*file'.*is a file,"
                    r" not a directory: pass a --workdir", WorkdirLock(path, comm).acquire)
  raises_everywhere(comm, r"could not create the work directory .*is a file, not a directory",
                    MetricsLog, path, comm)


def test_a_workdir_under_a_file(comm, shared):
  # Fails for root too (chmod does not stop root): the parent is a regular file.
  path = os.path.join(shared, "file", "run")
  if comm.is_root:
    open(os.path.join(shared, "file"), "w").close()
  comm.mpi_comm.Barrier()
  raises_everywhere(comm, r"Not a directory .*a parent of .* is a file, not a directory",
                    WorkdirLock(path, comm).acquire)
  raises_everywhere(comm, r"could not write config.json .*a parent of", write_config, path,
                    {"seed": 0}, comm)
  raises_everywhere(comm, r"could not write params.npz .*a parent of", save_params, path,
                    {"w": np.zeros(2)}, comm)


def test_failed_writes_reach_every_rank(comm, shared):
  if comm.is_root:  # directories where files go: fails for root too
    os.makedirs(os.path.join(shared, "config.json.tmp"))
    os.makedirs(os.path.join(shared, "params.npz.tmp"))
  comm.mpi_comm.Barrier()
  raises_everywhere(comm, r"could not write config.json .*config.json.tmp' is a directory where"
                    r" mnjax writes a file: move it away", write_config, shared, {"seed": 0}, comm)
  raises_everywhere(comm, r"could not write params.npz .*is a directory", save_params, shared,
                    {"w": np.zeros(2)}, comm)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_while_logging_reaches_every_rank(comm, shared):
  log = MetricsLog(shared, comm)
  if comm.is_root:
    os.symlink("/dev/full", log.path)  # every write: ENOSPC, for root too
  comm.mpi_comm.Barrier()
  raises_everywhere(comm, r"could not append to metrics.jsonl .*No space left on device.*free"
                    r" space or pass a --workdir on another disk", log.write, epoch=1)


def test_params_are_not_written_into_a_directory_another_run_took(comm, shared):
  plant_lock(comm, shared)
  raises_everywhere(comm, r"is in use by another run: pid", save_params,
                    shared, {"w": np.zeros(2)}, comm)
  assert not os.path.exists(os.path.join(shared, "params.npz"))
