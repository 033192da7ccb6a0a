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
the communicator the exchanges use (`StepCheck._over`: every rank of it must trace and
lower a step that exchanges over it, or call `mnjax.functions.jit` with a step that does
not). A mismatch raises the same `ExchangeError` on every rank at the step's first call (or
at ``jax.jit(f).lower(...)``), before anything is exchanged; the step then raises it again
at every lowering, never running unchecked. A sequence the ranks agreed on is not checked
again when the same step is retraced (`_AGREED`).

``jax.grad(jax.jit(f))`` differentiates the jitted step from outside: JAX then traces each
exchange's forward again, later, in a ``custom_vjp`` trace of its own (no parent, outside
`ambient`), one check per exchange, and the ranks' rounds would not line up. Such a trace's
check starts with a refusal (`OUTSIDE_GRAD`), which every rank's first round raises.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

from mnjax.comm._communicator import Communicator
from mnjax.comm._compat import outermost_trace, traced_for
from mnjax.guard import _pairing as pairing
from mnjax.guard import _preflight as preflight

__all__ = ["OUTSIDE_GRAD", "StepCheck", "ambient", "current"]

_CALLER = "mnjax.functions (a step under jax.jit)"

OUTSIDE_GRAD = (
    "mnjax.functions: an exchange was differentiated from outside its jitted step"
    " (jax.grad(jax.jit(f)), or jax.jit(jax.grad(jax.jit(f)))): JAX then traces each"
    " exchange's forward again in a trace of its own, so no check sees the step's sequence"
    " and the ranks' checks would not line up. Differentiate inside the jitted step:"
    " jax.jit(jax.grad(f))")

#: The sequences the ranks agreed on, by (world ranks of the check's communicator, the
#: step's function, sequence): a retrace of that step (another shape, on one rank or all)
#: with the same sequence opens no new round, as `mnjax.functions.jit`'s agreed set.
_AGREED: set[tuple] = set()
_AGREED_LOCK = threading.Lock()


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

  def __init__(self, step: str = ""):
    self.log: list[tuple] = []
    self.comms: list[Communicator] = []
    self.step = step  # the traced function (JAX's "f at file:line"): part of `_AGREED`'s key
    self._passed = False
    self._error: Exception | None = None
    self._lock = threading.Lock()

  def note(self, comm: Communicator | None, entry: tuple) -> None:
    """Adds one sequence entry ``(what, shape, dtype)`` of an exchange over `comm` (None: a
    refusal that names no communicator)."""
    self.log.append(entry)
    if comm is not None and all(c is not comm for c in self.comms):
      self.comms.append(comm)

  def run(self) -> None:
    """Checks the recorded sequence across the ranks (once; a refusal, or any error of the
    check, is raised again at every later lowering without a new round)."""
    with self._lock:
      if self._passed:
        return
      if self._error is not None:
        raise self._error
      try:
        over = self._over()
        world = pairing.world_ranks(over.mpi_comm)
        with _AGREED_LOCK:
          agreed = {log for w, step, log in _AGREED if (w, step) == (world, self.step)}
        preflight.check_collective_sequence(over, self.log, caller=_CALLER, agreed=agreed)
      except Exception as error:
        self._error = error
        raise
      with _AGREED_LOCK:
        _AGREED.add((world, self.step, tuple(self.log)))
      self._passed = True

  def _over(self) -> Communicator:
    """The communicator holding every rank the step's exchanges involve: the largest one
    used (ties: the lowest world ranks), when it holds the ranks of every other one.

    The choice is each rank's own, so every rank of a step must exchange over that same
    largest communicator (a rank whose exchanges use only a part of it checks over the
    part: its round is not the others'); `mnjax.functions.jit(step, comm)` names the
    communicator instead.
    """
    groups = [(c, set(pairing.world_ranks(c.mpi_comm))) for c in self.comms]
    for comm, group in sorted(groups, key=lambda cg: (-len(cg[1]), sorted(cg[1]))):
      if all(other <= group for _, other in groups):
        return comm
    sizes = ", ".join(f"{c.size} ranks (world {sorted(g)})" for c, g in groups)
    raise pairing.ExchangeError(
        f"{_CALLER}: the step exchanges over communicators none of which holds every rank of"
        f" the others ({sizes}), so no single check can pair them. Build the step with"
        " mnjax.functions.jit(step, comm) over a communicator holding them all (e.g. the"
        " job's).")


class _Current(threading.local):
  trace: weakref.ref | None = None  # of the outermost trace `check` belongs to
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
  if (_CURRENT.check is None or top is None or _CURRENT.trace is None
      or _CURRENT.trace() is not top):
    _CURRENT.trace = None if top is None else weakref.ref(top)
    _CURRENT.check = _new_check(top)
  return _CURRENT.check


def _new_check(top) -> StepCheck:
  """The `StepCheck` of outermost trace `top`: one that starts with a refusal when JAX traces
  an exchange's forward for a ``jax.grad`` outside the jitted step (`OUTSIDE_GRAD`)."""
  info = getattr(getattr(top, "frame", None), "debug_info", None)
  check = StepCheck(step="" if info is None else str(info.func_src_info))
  outer = traced_for()
  if outer and outer[-1].startswith("custom_vjp"):
    check.note(None, (pairing.entry(OUTSIDE_GRAD, "refused", ()), (), ""))
  return check


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
