"""A `jax.profiler` trace of a few training steps, on request (``--profile_steps``).

Which ops run how long, where the host waits, how the exchange overlaps the backward pass:
XLA's profiler answers that for a window of steps, viewed in TensorBoard's profile plugin
or Perfetto. `StepProfiler` starts ``jax.profiler.start_trace`` before the window's first
step and stops it after its last one has finished, on every rank, each rank into its own
directory (``rank<r>``: the trace files are named by host, and ranks on one host would
overwrite each other). Each traced step is a ``jax.profiler.StepTraceAnnotation`` named
``train``. Starting and stopping are agreed between the ranks (`mnjax.comm._devices.agree`,
one small collective at each edge of the window, at the same step everywhere): a rank whose
trace cannot start or be written raises the same error on every rank.

The window (`profile_window`): ``N`` traces N steps from the run's second step on (its first
compiles), ``A:B`` the global steps A .. B-1 (the step that takes ``state.step`` from A to
A+1 is step A), as in a Python slice; ``''`` traces nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import jax

from mnjax.comm._communicator import Communicator
from mnjax.comm._devices import agree

__all__ = ["StepProfiler", "profile_window"]


def profile_window(spec: str, first_step: int = 0) -> tuple[int, int] | None:
  """``(start, stop)``: the global steps ``start .. stop - 1`` that `spec` traces in a run
  whose first step is `first_step`, or None for ``''``; `ValueError` for anything else.

  Example:
    >>> profile_window("3", first_step=100), profile_window("10:13"), profile_window("")
    ((101, 104), (10, 13), None)
    >>> profile_window("5:5")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --profile_steps must be N (...) or A:B (global steps A .. B-1, A < B), ...
  """
  text = spec.strip()
  if not text:
    return None
  count = re.fullmatch(r"\d+", text)
  span = re.fullmatch(r"(\d+):(\d+)", text)
  if count and int(text) >= 1:
    return first_step + 1, first_step + 1 + int(text)
  if span and int(span[1]) < int(span[2]):
    return int(span[1]), int(span[2])
  raise ValueError(
      "--profile_steps must be N (trace N steps from the run's second step on) or A:B"
      f" (global steps A .. B-1, A < B), or '' for none; got {spec!r}.")


class StepProfiler:
  """Traces the steps of `window` (`profile_window`) into ``<directory>/rank<r>``.

  Collective: call `before` and `after` around every step on every rank with the same
  step numbers, and `close` when the run ends normally (it writes a trace the run left
  open). Used as a context manager, an exception stops a running trace on this rank alone.

  Example:
    >>> f, x = jax.jit(lambda x: x * 2), jnp.ones(3)
    >>> with StepProfiler((0, 2), "runs/x/profile", comm) as profiler:
    ...   for step in range(3):
    ...     with profiler.before(step):
    ...       x = f(x)
    ...     profiler.after(step + 1, x)
    >>> profiler.steps, len(os.listdir("runs/x/profile/rank0/plugins/profile"))  # one trace
    ([0, 1], 1)
  """

  def __init__(self, window: tuple[int, int] | None, directory: str | os.PathLike,
               comm: Communicator):
    self.window = window
    self.directory = os.path.join(os.fspath(directory), f"rank{comm.rank}")
    self.steps: list[int] = []  # the global steps traced so far
    self._comm = comm
    self._running = False

  def before(self, step: int) -> contextlib.AbstractContextManager:
    """Call before global step `step` runs: starts the trace at the window's first step;
    the context to run the step in (its annotation while tracing)."""
    if self.window is not None and not self._running and self.window[0] <= step < self.window[1]:
      agree(self._comm.mpi_comm, self._start)
    if not self._running:
      return contextlib.nullcontext()
    self.steps.append(step)
    return jax.profiler.StepTraceAnnotation("train", step_num=step)

  def after(self, steps: int, state: Any) -> None:
    """Call after a step, with the number of steps done and the new state: once the window's
    last step is done, waits for `state` and writes the trace."""
    if self._running and steps >= self.window[1]:
      self.close(state)

  def close(self, state: Any = None) -> None:
    """Waits for `state` and writes a trace still running; collective."""
    if self._running:
      jax.block_until_ready(state)
      self._running = False
      agree(self._comm.mpi_comm, jax.profiler.stop_trace)

  def _start(self) -> None:
    os.makedirs(self.directory, exist_ok=True)
    jax.profiler.start_trace(self.directory)
    self._running = True

  def __enter__(self) -> StepProfiler:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if self._running and exc_type is not None:  # this rank alone: no collective now
      self._running = False
      try:
        jax.profiler.stop_trace()
      except Exception:  # noqa: BLE001 (the run's own error is the one to report)
        pass
    elif self._running:
      self.close()
