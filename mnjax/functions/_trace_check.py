"""The pairing check of a step under plain ``jax.jit``: recorded while traced, run when lowered."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep._compat import outermost_trace, traced_for, traced_function
from mnjax.guard import _pairing as pairing
from mnjax.guard import _preflight as preflight

__all__ = ["HINT", "INNER_JIT", "OUTSIDE_GRAD", "StepCheck", "ambient", "current"]

_CALLER = "mnjax.functions (a step under jax.jit)"

#: Where an exchange belongs (the end of `_checks.BODY`, `INNER_JIT` and `_chain.GAP`).
HINT = (
    "Call mnjax.functions at the step's top level (a Python loop or condition on static"
    " values instead), or in the functions jax.grad, jax.value_and_grad or jax.vjp"
    " differentiate")

INNER_JIT = (
    "mnjax.functions.{caller}: called inside an inner jax.jit (a jitted function called from"
    " the jitted step): JAX caches its trace and reuses it in later steps without tracing"
    " the exchange again, so their checks would not see it. Call the exchanges in the"
    " step's own function (drop the inner jax.jit). " + HINT)

OUTSIDE_GRAD = (
    "mnjax.functions: an exchange was differentiated from outside its jitted step"
    " (jax.grad(jax.jit(f)), or jax.jit(jax.grad(jax.jit(f)))): JAX then traces each"
    " exchange's forward again in a trace of its own, so no check sees the step's sequence"
    " and the ranks' checks would not line up. Differentiate inside the jitted step:"
    " jax.jit(jax.grad(f))")

#: Agreed sequences by step function: {(world ranks, sequence)}; a retrace opens no new round.
#: Keyed by the function object (two closures of one factory are two steps), or by its source
#: location where JAX's frame is not found or the function cannot be weakly referenced.
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AGREED_BY_NAME: dict[str, set[tuple]] = {}
_AGREED_LOCK = threading.Lock()


def _agreed(step) -> set[tuple]:
  """The (world ranks, sequence) pairs agreed for `step` (call under `_AGREED_LOCK`)."""
  try:
    return _AGREED.setdefault(step, set())
  except TypeError:  # a string (source location) or an object without weak references
    return _AGREED_BY_NAME.setdefault(str(step), set())


class StepCheck:
  """The exchanges one outermost trace issued, and their check; hashed by identity.

  Example:
    >>> check = StepCheck()
    >>> check.note(comm, ("mnjax.functions.send <mnjax.functions send peer=1 phase=forward"
    ...                   " group=0,1>", (3,), "float32"))
    >>> len(check.log)
    1
  """

  def __init__(self, step: object = ""):
    self.log: list[tuple] = []
    self.comms: list[Communicator] = []
    self.step = step  # the traced function, else its "f at file:line": `_AGREED`'s key
    self._passed = False
    self._error: Exception | None = None
    self._lock = threading.Lock()

  def note(self, comm: Communicator | None, entry: tuple) -> None:
    """Adds one sequence entry ``(what, shape, dtype)`` over `comm` (None: a refusal)."""
    self.log.append(entry)
    if comm is not None and all(c is not comm for c in self.comms):
      self.comms.append(comm)

  def join(self, comm: Communicator) -> None:
    """Makes the check run over `comm` too, with no entry."""
    if all(c is not comm for c in self.comms):
      self.comms.append(comm)

  def run(self) -> None:
    """Checks the sequence across the ranks once; a failure is raised again at each call."""
    with self._lock:
      if self._passed:
        return
      if self._error is not None:
        raise self._error
      try:
        over = self._over()
        world = pairing.world_ranks(over.mpi_comm)
        with _AGREED_LOCK:
          agreed = {log for w, log in _agreed(self.step) if w == world}
        preflight.check_collective_sequence(over, self.log, caller=_CALLER, agreed=agreed)
      except Exception as error:
        self._error = error
        raise
      with _AGREED_LOCK:
        _agreed(self.step).add((world, tuple(self.log)))
      self._passed = True

  def refuse_reuse(self, caller: str) -> None:
    """Refuses this check's exchange lowered inside another program, on every rank.

    JAX reused a jitted function's trace, which this check paired when the function ran on
    its own, inside a step that calls it. A check round of its own carries the refusal, so
    a rank whose step traced the function afresh (and refused it there) meets it too.
    """
    refusal = StepCheck()
    for comm in self.comms:
      refusal.join(comm)
    refusal.note(None, (pairing.entry(INNER_JIT.format(caller=caller), "refused", ()), (), ""))
    refusal.run()

  def _over(self) -> Communicator:
    """The largest communicator used if it holds every other one's ranks, else `ExchangeError`."""
    groups = [(c, set(pairing.world_ranks(c.mpi_comm))) for c in self.comms]
    for comm, group in sorted(groups, key=lambda cg: (-len(cg[1]), sorted(cg[1]), cg[0].uid)):
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
  """The `StepCheck` of the outermost trace now traced, or the one `ambient` holds.

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
  """A new `StepCheck` for `top`; refused under ``jax.grad(jax.jit(f))``."""
  info = getattr(getattr(top, "frame", None), "debug_info", None)
  step = None if top is None else traced_function(top)
  if step is None:
    step = "" if info is None else str(info.func_src_info)
  check = StepCheck(step=step)
  outer = traced_for()
  if outer and outer[-1].startswith("custom_vjp"):
    check.note(None, (pairing.entry(OUTSIDE_GRAD, "refused", ()), (), ""))
  return check


@contextlib.contextmanager
def ambient() -> Iterator[None]:
  """Makes `current` answer the caller's `StepCheck` in the block (for a ``custom_vjp``'s trace).

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
