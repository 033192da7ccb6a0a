"""One rank fails, the whole job ends: an uncaught exception aborts every rank.

Without this, a rank that raises simply exits while its peers wait in the next collective
forever (MPI has no notion of a peer that left). `install(comm)` makes an uncaught
exception print its traceback prefixed with the rank and then call ``MPI_Abort``, which the
launcher (mpirun, srun) turns into the end of every process with a non-zero exit — what
``python -m mpi4py script.py`` does, without having to remember the ``-m``.

`mnjax.create_communicator` installs it by default when the job has more than one process
(``abort_on_error=False`` opts out). A rank killed outright (SIGKILL, out of memory) runs no
Python at all: mpirun ends the job by itself, and where a launcher does not (``srun``
without ``--kill-on-bad-exit``, ``mpiexec -disable-auto-cleanup``) the stall
`mnjax.Watchdog` notices the silent rank and aborts.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

from mpi4py import MPI

__all__ = ["abort", "install", "installed"]

#: Seconds between printing the error and aborting: ranks that fail at the same point (bad
#: input is usually seen by all) get to print their own message before the job ends.
GRACE_SECONDS = 2.0


def abort(message: str, *, errorcode: int = 1, grace: float = 0.0) -> None:
  """Prints `message` to stderr and, after `grace` seconds, aborts every rank of
  ``MPI.COMM_WORLD``.

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
  """Makes an uncaught exception on this rank abort the whole MPI job, naming the rank.

  Idempotent. Does nothing on a single-process job (there is nobody to wait for it) or in
  an interactive session, where the interpreter survives exceptions.

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
