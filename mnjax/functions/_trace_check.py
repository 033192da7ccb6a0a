"""The pairing check of a step traced under plain ``jax.jit``: recorded while traced, run when
lowered.

`mnjax.functions.jit` (``mnjax.data_parallel``) opens a recording around the step and checks
it when the trace ends. Plain ``jax.jit`` gives no such hook, so the exchanges of a step
traced without one record themselves in a `StepCheck` of their own: one per outermost trace
(``jax.jit(f)``'s trace of ``f``, which the traces ``jax.grad`` opens inside it share), which
every exchange of that trace carries as a parameter of its primitive. JAX lowers a jitted
function after tracing it and before compiling and running it, so the first exchange lowered
runs the check over the whole sequence (`run`): the same
`mnjax.guard._preflight.check_collective_sequence` as `mnjax.functions.jit`, collective over
the communicator the exchanges use (every rank of it must trace and lower a step that
exchanges over it, or call `mnjax.functions.jit` with a step that does not). A mismatch
raises the same `ExchangeError` on every rank at the step's first call (or at
``jax.jit(f).lower(...)``), before anything is exchanged; the step then raises it again at
every lowering, never running unchecked.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from mnjax.comm._communicator import Communicator
from mnjax.comm._compat import outermost_trace
from mnjax.guard import _pairing as pairing
from mnjax.guard import _preflight as preflight

__all__ = ["StepCheck", "ambient", "current"]

_CALLER = "mnjax.functions (a step under jax.jit)"


class StepCheck:
  """The exchanges one outermost trace issued, and their check (run once, when lowered).

  Hashed and compared by identity: it is a parameter of the exchange primitive.

  Example:
    >>> check = StepCheck()
    >>> check.note(comm, ("mnjax.functions.send <mnjax.functions send peer=1 phase=forward"
    ...                   " group=0,1>", (3,), "float32"))
    >>> len(check.log)
    1
  """

  def __init__(self):
    self.log: list[tuple] = []
    self.comms: list[Communicator] = []
    self._passed = False
    self._error: BaseException | None = None

  def note(self, comm: Communicator, entry: tuple) -> None:
    """Adds one sequence entry ``(what, shape, dtype)`` of an exchange over `comm`."""
    self.log.append(entry)
    if all(c is not comm for c in self.comms):
      self.comms.append(comm)

  def run(self) -> None:
    """Checks the recorded sequence across the ranks (once; a refusal is raised again at
    every later lowering)."""
    if self._passed:
      return
    if self._error is not None:
      raise self._error
    try:
      preflight.check_collective_sequence(self._over(), self.log, caller=_CALLER)
    except (ValueError, TimeoutError) as error:
      self._error = error
      raise
    self._passed = True

  def _over(self) -> Communicator:
    """The communicator holding every rank the step's exchanges involve."""
    groups = [(c, set(pairing.world_ranks(c.mpi_comm))) for c in self.comms]
    for comm, group in sorted(groups, key=lambda cg: -len(cg[1])):
      if all(other <= group for _, other in groups):
        return comm
    sizes = ", ".join(f"{c.size} ranks (world {sorted(g)})" for c, g in groups)
    error = pairing.ExchangeError(
        f"{_CALLER}: the step exchanges over communicators none of which holds every rank of"
        f" the others ({sizes}), so no single check can pair them. Build the step with"
        " mnjax.functions.jit(step, comm) over a communicator holding them all (e.g. the"
        " job's).")
    self._error = error
    raise error


class _Current(threading.local):
  trace: Any = None
  check: StepCheck | None = None
  ambient: StepCheck | None = None


_CURRENT = _Current()


def current() -> StepCheck:
  """The `StepCheck` of the outermost trace being traced now (a new one for a new trace), or
  the one `ambient` holds.

  Example:
    >>> def step(x):
    ...   assert current() is current()          # one per traced step
    ...   return x
    >>> float(jax.jit(step)(1.0))
    1.0
  """
  if _CURRENT.ambient is not None:
    return _CURRENT.ambient
  top = outermost_trace()
  if _CURRENT.check is None or top is None or _CURRENT.trace is not top:
    _CURRENT.trace, _CURRENT.check = top, StepCheck()
  return _CURRENT.check


@contextlib.contextmanager
def ambient() -> Iterator[None]:
  """Makes `current` answer the caller's `StepCheck` while the block runs: JAX traces a
  ``custom_vjp``'s function in a trace of its own, without a parent, so the exchanges its
  forward issues could not find their step otherwise.

  Example:
    >>> with ambient():
    ...   outer = current()
    ...   with ambient():
    ...     inner = current()
    >>> inner is outer
    True
  """
  saved = _CURRENT.ambient
  _CURRENT.ambient = current()
  try:
    yield
  finally:
    _CURRENT.ambient = saved
