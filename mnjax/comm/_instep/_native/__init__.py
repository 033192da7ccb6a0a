"""MPI collectives as XLA:CPU FFI handlers (`mpi_collectives.cc`), compiled on first use."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["DEFAULT_WAIT_TIMEOUT", "LIBRARY", "NOTICE_AFTER", "SOURCE", "SOURCES", "TARGETS",
           "WAIT_TIMEOUT_ENV", "HostWait",
           "allreduce_calls", "collective_counts", "configure_waits", "handlers",
           "is_stale", "register", "wait_timeout"]


def _abi_suffix() -> str:
  """'' under MPICH, else ``-<vendor>``: one library per MPI sharing the source tree."""
  from mpi4py import MPI  # noqa: PLC0415 (already loaded by mnjax.comm)

  vendor = MPI.get_vendor()[0]
  return "" if vendor == "MPICH" else "-" + "".join(c for c in vendor.lower() if c.isalnum())


SOURCE = Path(__file__).with_name("mpi_collectives.cc")
#: Every file the library is built from (SOURCE includes the others).
SOURCES = (SOURCE, *(Path(__file__).with_name(h) for h in ("mpi_ranks.h", "wait_notices.h")))
LIBRARY = Path(__file__).with_name(f"_mpi_collectives{_abi_suffix()}.so")
TARGETS = ("mnjax_mpi_allreduce_start", "mnjax_mpi_allreduce_start_linked",
           "mnjax_mpi_allreduce_start_linked_tagged", "mnjax_mpi_allreduce_done",
           "mnjax_mpi_allreduce_done_keeping", "mnjax_mpi_alltoall", "mnjax_mpi_allgather",
           "mnjax_mpi_allreduce_start_tagged", "mnjax_mpi_alltoall_tagged",
           "mnjax_mpi_allgather_tagged", "mnjax_mark",
           # `mnjax.functions` (model parallelism): point-to-point and rooted collectives
           "mnjax_mpi_send", "mnjax_mpi_recv", "mnjax_mpi_bcast", "mnjax_mpi_gather",
           "mnjax_mpi_scatter", "mnjax_mpi_reduce")


def is_stale() -> bool:
  """True when the library is missing or older than its source.

  Example:
    >>> mnjax.comm._instep._native.is_stale()
    False
  """
  return not LIBRARY.exists() or LIBRARY.stat().st_mtime < max(s.stat().st_mtime for s in SOURCES)


@functools.cache
def _library() -> ctypes.CDLL:
  if is_stale():
    from mnjax.comm._instep._native._build import build  # noqa: PLC0415 (only to compile)

    build()
  # MPI symbols resolve against the libmpi that mpi4py already loaded (the same file).
  return ctypes.CDLL(str(LIBRARY))


def allreduce_calls() -> int:
  """How many allreduces this process's mnjax handlers have completed.

  Example:
    >>> step = jax.jit(lambda v: mnjax.comm._instep._primitives.allreduce_sum(v, comm.device_comm))
    >>> before = mnjax.comm._instep._native.allreduce_calls()
    >>> _ = jax.block_until_ready(step(jnp.ones(3)))    # one in-step allreduce
    >>> mnjax.comm._instep._native.allreduce_calls() - before
    1
  """
  fn = _library().mnjax_allreduce_calls
  fn.restype = ctypes.c_int64
  return int(fn())


def collective_counts() -> tuple[int, int]:
  """``(entered, completed)`` in-step collectives of this process (more entered: one waits).

  Example:
    >>> entered, completed = mnjax.comm._instep._native.collective_counts()
    >>> entered == completed     # no collective is waiting for its peers
    True
  """
  lib = _library()
  entered, completed = lib.mnjax_collectives_entered, lib.mnjax_collectives_completed
  entered.restype = completed.restype = ctypes.c_int64
  completed_first = int(completed())  # read completed first: never more completed than entered
  return int(entered()), completed_first


def handlers() -> dict:
  """FFI handler capsules by target name (`TARGETS`), built if needed.

  Example:
    >>> for name, capsule in mnjax.comm._instep._native.handlers().items():
    ...   jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  """
  from jax import ffi  # noqa: PLC0415 (the counters and is_stale work without importing jax)

  lib = _library()
  return {name: ffi.pycapsule(getattr(lib, name)) for name in TARGETS}


#: The environment variable that bounds an in-step point-to-point wait, in seconds.
WAIT_TIMEOUT_ENV = "MNJAX_WAIT_TIMEOUT"
#: Its default: a peer that has not done its part of a send or recv after this long ends the job.
DEFAULT_WAIT_TIMEOUT = 300.0


def wait_timeout() -> float:
  """The bound on an in-step send, recv or allreduce wait: ``MNJAX_WAIT_TIMEOUT`` or 300 s.

  Example:
    >>> mnjax.comm._instep._native.wait_timeout() > 0
    True
  """
  raw = os.environ.get(WAIT_TIMEOUT_ENV, "")
  try:
    value = float(raw) if raw else DEFAULT_WAIT_TIMEOUT
  except ValueError:
    value = -1.0
  if not value > 0:
    raise ValueError(f"{WAIT_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}.")
  return value


def configure_waits() -> None:
  """Hands the handlers their wait bound, the exit notices' tag (a lost peer ends the job) and
  the wait notices' tag (two ranks waiting for each other in a step and a host round)."""
  from mnjax.comm import _departures as departures  # noqa: PLC0415 (mpi4py only when used)

  fn = _library().mnjax_configure_waits
  fn.argtypes = [ctypes.c_double, ctypes.c_int64, ctypes.c_int64]
  fn(wait_timeout(), departures.TAG, departures.WAIT_TAG)


@functools.cache
def register() -> None:
  """Registers every handler with XLA:CPU once per process (before a lowering names one)."""
  from jax import ffi  # noqa: PLC0415 (the counters and is_stale work without importing jax)

  configure_waits()

  for name, capsule in handlers().items():
    ffi.register_ffi_target(name, capsule, platform="cpu")


#: Seconds a wait lasts before it tells the ranks it waits for (``kNoticeAfter`` in
#: wait_notices.h): shorter waits send nothing.
NOTICE_AFTER = 5.0
_IN_STEP_WAIT = 1  # WaitKind kInStepWait (wait_notices.h)


@functools.cache
def _notices() -> ctypes.CDLL | None:
  """The library with its wait notices on, or None where it cannot be loaded (notices off)."""
  try:
    configure_waits()
  except (OSError, RuntimeError, ValueError):
    return None
  lib = _library()
  lib.mnjax_wait_begin.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int64, ctypes.c_char_p,
                                   ctypes.c_int64]
  lib.mnjax_wait_begin.restype = ctypes.c_int64
  lib.mnjax_wait_check.argtypes = [ctypes.c_int64, ctypes.c_double, ctypes.c_char_p,
                                   ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
  lib.mnjax_wait_check.restype = ctypes.c_int64
  lib.mnjax_wait_end.argtypes = [ctypes.c_int64]
  lib.mnjax_wait_alongside.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int),
                                       ctypes.c_int64]
  lib.mnjax_wait_alongside.restype = ctypes.c_int64
  return lib


class HostWait:
  """A host round's wait as the other waits see it (wait_notices.h): once it has lasted
  `NOTICE_AFTER`, the ranks it waits for are told, and `check` finds a peer that waits for
  this rank only where this wait can never meet it: in a step's exchange, or in a host round
  of another communicator (`scope`: the communicator's ``uid``; 0 when unknown).

  `peers` gives the world ranks it waits for, asked once the wait is long.

  Example:
    >>> wait = HostWait(lambda: [], "a barrier", scope=7)
    >>> wait.check(0.0) is None
    True
    >>> wait.end()
  """

  def __init__(self, peers: Callable[[], list[int]], what: str, scope: int = 0):
    self._peers, self._what, self._id = peers, what, 0
    self._scope = int(scope) & 0x7FFF_FFFF_FFFF_FFFF  # a uid, as an int64 that is never < 0

  def check(self, waited: float) -> tuple[int, str, bool] | None:
    """``(world rank, what it waits in, whether that is a step's exchange)`` of a peer this
    wait can never meet, else None."""
    if waited < NOTICE_AFTER:
      return None
    lib = _notices()
    if lib is None:
      return None
    if self._id == 0:
      peers = self._peers()
      self._id = lib.mnjax_wait_begin((ctypes.c_int * len(peers))(*peers), len(peers),
                                      self._what.encode()[:92], self._scope)
    theirs, kind = ctypes.create_string_buffer(128), ctypes.c_int64(0)
    peer = lib.mnjax_wait_check(self._id, waited, theirs, len(theirs), ctypes.byref(kind))
    if peer < 0:
      return None
    return int(peer), theirs.value.decode(errors="replace"), kind.value == _IN_STEP_WAIT

  def told(self) -> bool:
    """Whether this wait told its peers (notices on, and it lasted `NOTICE_AFTER`)."""
    return self._id != 0

  def alongside(self) -> list[int]:
    """The world ranks this wait needs that told of waiting in it too."""
    if not self._id:
      return []
    lib = _library()
    n = lib.mnjax_wait_alongside(self._id, None, 0)  # how many, then which
    out = (ctypes.c_int * n)()
    n = min(n, lib.mnjax_wait_alongside(self._id, out, n))
    return sorted(out[:n])

  def end(self) -> None:
    """Tells the peers this wait ended (if they were told it began)."""
    if self._id:
      _library().mnjax_wait_end(self._id)
      self._id = 0
