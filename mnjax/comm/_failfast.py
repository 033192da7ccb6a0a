"""One rank fails, the whole job ends: an uncaught exception prints its rank-prefixed traceback
and calls ``MPI_Abort`` instead of leaving the peers waiting (docs/design/failures.md)."""

from __future__ import annotations

import sys
import threading
import time
import traceback

from mpi4py import MPI

__all__ = ["abort", "install", "installed"]

#: Seconds between printing the error and aborting, so other failing ranks print theirs.
GRACE_SECONDS = 2.0
#: Seconds between printing and aborting by default: the abort reaches the launcher by
#: another channel than the rank's output, and a launcher that ends the job first drops what
#: it has not forwarded yet (MPICH's mpiexec under load: the whole message).
FLUSH_SECONDS = 1.0


def abort(message: str, *, errorcode: int = 1, grace: float = FLUSH_SECONDS) -> None:
  """Prints `message` to stderr and, after `grace` seconds, aborts every rank of the job.

  Example:
    >>> abort("rank 3: data shard missing")   # never returns  # doctest: +SKIP
  """
  sys.stderr.write(message if message.endswith("\n") else message + "\n")
  sys.stderr.flush()
  sys.stdout.flush()
  time.sleep(grace)
  MPI.COMM_WORLD.Abort(errorcode)


def _hook(exc_type, exc, tb) -> None:
  rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
  text = "".join(traceback.format_exception(exc_type, exc, tb))
  prefixed = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines())
  abort(f"{prefixed}mnjax: rank {rank} of {size} failed with {exc_type.__name__}; aborting"
        " all ranks (MPI_Abort) so that none waits for it forever.", grace=GRACE_SECONDS)


def install() -> None:
  """Makes an uncaught exception on this rank abort the whole MPI job, naming the rank
  (idempotent; nothing on one process or in an interactive session).

  Example:
    >>> comm = mnjax.create_communicator("flat")   # installs it already, or by hand:
    >>> mnjax.comm._failfast.install()
  """
  if MPI.COMM_WORLD.Get_size() == 1 or installed() or hasattr(sys, "ps1"):
    return
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("mnjax.comm._failfast.install must be called from the main thread.")
  sys.excepthook = _hook


def installed() -> bool:
  """True when uncaught exceptions abort the job.

  Example:
    >>> mnjax.comm._failfast.installed()   # a size-1 job: nobody waits for it
    False
  """
  return sys.excepthook is _hook
