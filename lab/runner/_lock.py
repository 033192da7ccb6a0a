"""One writer per work directory, and work-directory errors that reach every rank.

Two runs in one work directory would interleave their epochs in one ``metrics.jsonl`` and
race their checkpoints. `WorkdirLock` stops the second run at the start, on every rank,
naming the run that holds the directory. The lock is the file
``<workdir>/mnjax.lock``, created atomically (``O_CREAT | O_EXCL``) by rank 0 before
anything else is written there; it names the holder's host, pid, start time and job size
and is removed when the run ends, normally or by an exception. A run killed outright leaves
it behind: a lock whose process no longer exists on this host is *stale* and is taken over,
with a note. A lock written on another host cannot be checked from here; the message says
how to remove it when that run is gone.

Only rank 0 touches the work directory, so an ``OSError`` there (the directory is a file, a
parent is a file, it is read-only, the disk is full) would end rank 0 alone with a raw
traceback while the other ranks wait. `on_root` runs rank 0's part and
agrees on the outcome (`mnjax.comm._devices.agree`): every rank raises the same
`RuntimeError`, saying what failed and what to do.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._devices import agree

__all__ = ["LOCK_NAME", "WorkdirLock", "check_not_taken", "io_error_message", "on_root"]

LOCK_NAME = "mnjax.lock"


def io_error_message(workdir: str, what: str, error: OSError) -> str:
  """What went wrong writing the work directory, and how to fix it.

  Example:
    >>> denied = PermissionError(errno.EACCES, "Permission denied", "runs/x/config.json")
    >>> print(io_error_message("runs/x", "write config.json in the work directory", denied))
    ... # doctest: +ELLIPSIS
    mnjax: could not write config.json in the work directory 'runs/x': Permission denied ...
  """
  where = error.filename or workdir
  reason = error.strerror or str(error)
  code = error.errno
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    advice = (f"{workdir!r} is a file, not a directory: pass a --workdir that is a directory"
              " or does not exist yet, or move the file away.")
  elif code == errno.ENOTDIR:
    advice = (f"a parent of {where!r} is a file, not a directory: pass a --workdir whose"
              " parents are directories, or move the file away.")
  elif code == errno.EISDIR:
    advice = f"{where!r} is a directory where mnjax writes a file: move it away."
  elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
    advice = ("this process may not write there: pass a --workdir on a writable file system,"
              " or make the directory writable for this user.")
  elif code in (errno.ENOSPC, errno.EDQUOT):
    advice = ("the file system is full (or the quota is used up): free space or pass a"
              " --workdir on another disk; with --resume the run continues from the newest"
              " checkpoint.")
  else:
    advice = "check that the work directory is a writable directory on a working file system."
  return f"mnjax: could not {what} {workdir!r}: {reason} ({where}). Fix: {advice}"


def on_root(comm: Communicator, workdir: str, what: str, fn: Callable, *args: Any) -> Any:
  """``fn(*args)`` on rank 0 (None elsewhere); if it fails, the same error on every rank.

  `what` completes "could not ... <workdir>" in the message.

  Collective. An ``OSError`` becomes a `RuntimeError` with `io_error_message`'s advice; any
  other exception keeps its message (`mnjax.comm._devices.agree`).

  Example:
    >>> on_root(comm, "runs/x", "create the work directory", os.makedirs, "runs/x", 0o777, True)
  """
  def attempt():
    if not comm.is_root:
      return None
    try:
      return fn(*args)
    except OSError as error:
      raise RuntimeError(io_error_message(workdir, what, error)) from error
  return agree(comm.mpi_comm, attempt)


# -- the lock file -------------------------------------------------------------------------


def _process_start(pid: int) -> str | None:
  """The kernel's start time of `pid` (``/proc/<pid>/stat`` field 22): tells a reused pid."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _read(path: str) -> dict | None:
  """The lock's holder; ``{}`` when the file is unreadable; None when there is no lock."""
  try:
    with open(path) as f:
      holder = json.load(f)
  except (FileNotFoundError, NotADirectoryError):
    return None
  except (OSError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _alive(holder: dict) -> bool | None:
  """Whether the holder's process still runs; None when it ran on another host."""
  if holder.get("host") != socket.gethostname():
    return None
  pid = holder.get("pid")
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process: it exists
    pass
  then, now = holder.get("process_start"), _process_start(pid)
  return not (then and now and then != now)  # a new process under an old pid: stale


def _describe(holder: dict) -> str:
  if not holder:
    return "an unknown run (the lock file cannot be read)"
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
  return (f"pid {holder.get('pid')} on host {holder.get('host')!r}, started {started}"
          f" ({holder.get('ranks')} ranks: {holder.get('command', '?')})")


def _in_use(workdir: str, path: str, holder: dict, alive: bool | None) -> str:
  gone = ("that process is still running" if alive else
          "mnjax cannot tell from this host whether it still runs")
  return (f"mnjax: the work directory {workdir!r} is in use by another run: {_describe(holder)};"
          f" {gone}. Two runs in one work directory would mix their metrics and checkpoints."
          f" Fix: wait for that run to end, or pass another --workdir; if it is no longer"
          f" running, delete {path} and start again.")


def _create(path: str, holder: dict) -> None:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(holder, f, indent=1)
      f.write("\n")
  except BaseException:  # a full disk: leave no empty lock that would block the next run
    os.unlink(path)
    raise


def _take(workdir: str, path: str, holder: dict) -> dict | None:
  """Creates the lock (rank 0) -> the stale holder taken over, or None."""
  os.makedirs(workdir, exist_ok=True)
  for _ in range(5):  # each round loses only to a run that has just taken or freed the lock
    try:
      _create(path, holder)
      return None
    except FileExistsError:
      pass
    current = _read(path)
    if current is None:  # freed meanwhile
      continue
    alive = _alive(current) if current else None
    if alive is not False:
      raise RuntimeError(_in_use(workdir, path, current, alive))
    guard = path + ".takeover"  # one contender breaks a stale lock, the others see it held
    try:
      os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
      raise RuntimeError(
          f"mnjax: the work directory {workdir!r} is in use: another run is taking over its"
          f" stale lock ({_describe(current)}). Fix: pass another --workdir, or, if no run"
          f" uses the directory, delete {guard} and start again.") from None
    try:
      if _read(path) == current:
        os.unlink(path)
      try:
        _create(path, holder)
        return current
      except FileExistsError:
        continue  # a third run took it between unlink and create
    finally:
      os.unlink(guard)
  raise RuntimeError(f"mnjax: could not take the lock {path}: other runs keep taking and"
                     " freeing it. Fix: run one job per work directory.")


def check_not_taken(workdir: str) -> None:
  """Raises unless `workdir` is unlocked or locked by this process (rank 0, local).

  What a write after the loop (``params.npz``) checks: another run may have taken the
  directory since this one released it.

  Example:
    >>> check_not_taken("runs/x")   # no lock, or this process's
  """
  path = os.path.join(workdir, LOCK_NAME)
  holder = _read(path)
  if holder is None or (holder.get("host") == socket.gethostname()
                        and holder.get("pid") == os.getpid()):
    return
  alive = _alive(holder) if holder else None
  if alive is not False:
    raise RuntimeError(_in_use(workdir, path, holder, alive))


class WorkdirLock:
  """``<workdir>/mnjax.lock``: one run per work directory (what `train_loop` holds).

  `acquire` is collective: rank 0 creates the directory and the lock file (holder's host,
  pid, start time, job size, command), and every rank raises the same `RuntimeError` when
  another live run holds it. A stale lock (its process gone on this host) is taken over:
  rank 0 prints a note and `took_over` names the old holder. `release` is local to rank 0
  (no communication, safe while unwinding an exception) and removes only its own lock.

  Example:
    >>> with WorkdirLock("runs/x", comm) as lock:
    ...   lock.held
    True
  """

  def __init__(self, workdir: str | os.PathLike, comm: Communicator):
    check_communicator(comm, "WorkdirLock")
    self.workdir = os.fspath(workdir)
    self.comm = comm
    self.path = os.path.join(self.workdir, LOCK_NAME)
    self.held = False
    self.took_over: dict | None = None
    self._holder: dict = {}

  def acquire(self) -> WorkdirLock:
    """Takes the lock (collective); raises the same `RuntimeError` on every rank if held."""
    if self.held:
      raise RuntimeError(f"WorkdirLock: {self.path} is already held by this object.")
    self._holder = {
        "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
        "process_start": _process_start(os.getpid()), "ranks": self.comm.size,
        "kind": self.comm.kind, "command": " ".join(sys.argv)[:500],
    }
    self.took_over = on_root(self.comm, self.workdir, "open the work directory",
                             _take, self.workdir, self.path, self._holder)
    self.held = True
    if self.took_over:
      print(f"mnjax: took over the stale lock of {_describe(self.took_over)} in"
            f" {self.workdir!r}: that process no longer exists (killed or crashed).",
            flush=True)
    return self

  def release(self) -> None:
    """Removes the lock file if it is still this run's (rank 0; never communicates)."""
    if not self.held:
      return
    self.held = False
    if self.comm.is_root and _read(self.path) == self._holder:
      try:
        os.unlink(self.path)
      except OSError:
        pass  # the directory went away or became read-only: the next run sees it stale

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
