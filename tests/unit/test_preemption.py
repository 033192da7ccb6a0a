"""lab/runner/_preemption.py in one process: which signals, requeue detection, a signal
turned into a request (size 1: no exchange)."""

import os
import signal

import pytest
from mpi4py import MPI

import lab.runner
import mnjax
from lab.runner import PreemptionSignals, parse_signals, requeued


def test_signal_names_are_checked_when_the_config_is_built():
  assert parse_signals("TERM, usr1,SIGUSR2") == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
  assert parse_signals("") == ()
  with pytest.raises(ValueError, match="'KILL' is not a signal a process can catch"):
    lab.runner.RunConfig(epochs=1, global_batch_size=8, workdir="w", checkpoint_on_signal="KILL")


def test_a_requeued_slurm_job_is_recognised(monkeypatch):
  monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
  assert not requeued()
  monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
  assert not requeued()
  monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
  assert requeued()


def test_the_first_signal_is_a_request_and_the_handler_is_restored():
  comm = mnjax.create_communicator("flat", mpi_comm=MPI.COMM_SELF)
  before = signal.getsignal(signal.SIGUSR2)
  with PreemptionSignals(comm, (signal.SIGUSR2,)) as preemption:
    assert preemption.poll() == 0
    os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.poll() == signal.SIGUSR2
  assert signal.getsignal(signal.SIGUSR2) is before
