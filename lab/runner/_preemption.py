"""Preemption as clusters do it: a signal asks the run to checkpoint and stop.

Slurm ends a job with SIGTERM, then SIGKILL after its grace time (``KillWait``: ``scancel``,
preemption, a requeue); ``--signal=USR1@60`` warns a job a minute before its time limit. By
default a Python process dies at SIGTERM/SIGUSR1 and the work since the last checkpoint is
lost. `PreemptionSignals` turns the first such signal into a request: `train_loop` polls it
after every step, every rank sees the request at the same step (one small non-blocking
allreduce per step, on its own clone of the communicator, completed one step later so that
it never waits on the wire), checkpoints there and ends with `Preempted` (a `SystemExit`
with the shell's code for the signal, 128 + signum). The same job with ``--resume`` — or a
Slurm job that was requeued (``SLURM_RESTART_COUNT`` > 0, see `requeued`), by itself —
continues bit for bit. Later signals are ignored (Slurm may send SIGTERM twice; its SIGKILL
after ``KillWait`` still ends a rank that is stuck outside the loop).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.comm._communicator import Communicator

__all__ = ["Preempted", "PreemptionSignals", "parse_signals", "requeued"]


class Preempted(SystemExit):
  """The run checkpointed after a preemption signal and stops (exit code 128 + signum)."""


def parse_signals(text: str, what: str = "--checkpoint_on_signal") -> tuple[signal.Signals, ...]:
  """Signals named in `text` (``"TERM,USR1"``, ``"SIGTERM"``, ``""``: none).

  Example:
    >>> parse_signals("TERM,USR1")
    (<Signals.SIGTERM: 15>, <Signals.SIGUSR1: 10>)
  """
  found = []
  for name in filter(None, (part.strip().upper() for part in text.split(","))):
    full = name if name.startswith("SIG") else "SIG" + name
    if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
      raise ValueError(f"{what}: '{name}' is not a signal a process can catch; use names such"
                       " as TERM, USR1, USR2 (comma-separated), or '' for none.")
    found.append(signal.Signals[full])
  return tuple(found)


def requeued() -> bool:
  """True in a Slurm job that was requeued (``SLURM_RESTART_COUNT`` > 0): `train_loop`
  resumes such a run without ``--resume``.

  Example:
    >>> requeued()   # not a requeued Slurm job
    False
  """
  try:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
  except ValueError:
    return False


class PreemptionSignals:
  """While entered, the first of `signals` requests a checkpoint-and-stop (collective).

  Build and enter it on every rank; call `poll` at the same points on every rank (the loop
  does, once per step). Leaving restores the previous handlers.

  Example:
    >>> with PreemptionSignals(comm, parse_signals("USR1")) as preemption:
    ...   preemption.poll()          # no signal came: 0
    0
  """

  def __init__(self, comm: Communicator, signals: tuple[signal.Signals, ...]):
    self.signals = tuple(signals)
    self._size = comm.size
    self._mpi: Any = comm.mpi_comm.Dup() if comm.size > 1 else None  # collective
    self._local = 0
    self._send = np.zeros(1, np.int32)
    self._recv = np.zeros(1, np.int32)
    self._request: Any = None
    self._previous: dict = {}

  def _handle(self, signum, frame) -> None:
    # Repeats are ignored: Slurm often delivers SIGTERM twice (slurmstepd, and srun
    # forwarding it), and its SIGKILL after KillWait ends a rank that never polls again.
    self._local = self._local or signum

  def __enter__(self) -> PreemptionSignals:
    for sig in self.signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def poll(self) -> int:
    """The signal number some rank received by the previous call (0: none). The same on
    every rank; collective."""
    if self._mpi is None:
      return self._local
    agreed = 0
    if self._request is not None:
      self._request.Wait()
      agreed = int(self._recv[0])
    self._send[0] = self._local
    self._request = self._mpi.Iallreduce(self._send, self._recv, op=MPI.MAX)
    return agreed

  def __exit__(self, exc_type, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    if self._mpi is not None:
      if exc_type is None or issubclass(exc_type, Preempted):
        if self._request is not None:  # every rank has one exchange in flight
          self._request.Wait()
        self._mpi.Free()
