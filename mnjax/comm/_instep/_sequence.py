"""A step's in-step collectives, noted while it is traced (its fingerprint for the pre-flight
check), and `ORDER`, which chains them (docs/design/allreduce.md, section 2)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as _jax_core  # the trace identity that scopes the order chain
from mpi4py import MPI

from mnjax.comm._instep import _entry_tag as entry_tag
from mnjax.comm._instep._compat import usable_here

__all__ = [
    "ORDER", "current_recording", "enclosing", "enclosing_options", "note_collective", "noted",
    "per_device_state_kept", "recording", "recording_open", "state_from_first_device",
]


class _Recordings(threading.local):
  """The sequences being recorded by the open `recording` blocks of this thread."""

  def __init__(self):
    self.open: list[list[tuple]] = []


_RECORDINGS = _Recordings()


def note_collective(what: str, shape: Any, dtype: Any, *, over: Any = None) -> None:
  """Notes a collective being traced in every open `recording` (`over`: its MPI communicator).

  Example:
    >>> with recording() as log:
    ...   note_collective("SyncBatchNorm layer BatchNorm_0", (3, 16), "float32")
    >>> log
    [('SyncBatchNorm layer BatchNorm_0', (3, 16), 'float32')]
  """
  if over is not None and over.Get_size() < MPI.COMM_WORLD.Get_size() and _RECORDINGS.open:
    what = entry_tag.entry(what, "collective", entry_tag.world_ranks(over))
  for log in _RECORDINGS.open:
    log.append((what, tuple(int(d) for d in shape), str(dtype)))


def current_recording() -> list[tuple] | None:
  """The innermost open `recording`'s list, or None.

  Example:
    >>> with recording() as log:
    ...   current_recording() is log
    True
  """
  return _RECORDINGS.open[-1] if _RECORDINGS.open else None


def recording_open() -> bool:
  """Whether a `recording` is open on this thread (a step is traced under the check).

  Example:
    >>> with recording():
    ...   recording_open()
    True
  """
  return bool(_RECORDINGS.open)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
  """The list of collectives `note_collective` notes while the block runs.

  Example:
    >>> with recording() as log:
    ...   pass                    # e.g. out = fn(*args), while tracing the step
    >>> log
    []
  """
  log: list[tuple] = []
  _RECORDINGS.open.append(log)
  try:
    yield log
  finally:
    _RECORDINGS.open.pop()


def noted(prefix: str) -> bool:
  """Whether an open `recording` holds a collective whose description starts with `prefix`.

  Example:
    >>> with recording():
    ...   note_collective("SyncBatchNorm layer BatchNorm_0", (3, 16), "float32")
    ...   noted("SyncBatchNorm")
    True
  """
  return any(what.startswith(prefix) for log in _RECORDINGS.open for what, _, _ in log)


class _OrderChain(threading.local):
  """The last in-step collective of the computation being traced (per thread and trace).

  Example:
    >>> def step(x):
    ...   first = ORDER.take(x.dtype)    # nothing before it in this trace: a zero
    ...   ORDER.put(x * 2)               # e.g. the result of this collective
    ...   return ORDER.last() is not None
    >>> step(jnp.ones(3))
    True
  """

  def __init__(self):
    self._trace = None
    self._last = None

  def last(self) -> jax.Array | None:
    """The last collective's result in the current trace, or None."""
    if self._last is not None and self._trace == _jax_core.get_opaque_trace_state():
      return self._last
    return None

  def take(self, dtype) -> jax.Array:
    """`last`, or a zero scalar of `dtype` when the chain starts here."""
    last = self.last()
    return jnp.zeros((), dtype) if last is None else last

  def put(self, value: jax.Array) -> None:
    """Makes `value` (a collective's result) the chain's last link in the current trace."""
    self._trace = _jax_core.get_opaque_trace_state()
    self._last = value

  def reachable(self) -> jax.Array | None:
    """The last link if usable here (also an enclosing trace's, for ``custom_vjp``), or None."""
    return usable_here(self._last)

  def stale(self) -> jax.Array | None:
    """The last link, even when no longer usable here (to tell a gap in the chain)."""
    return self._last


ORDER = _OrderChain()


class _Enclosing(threading.local):
  """The options of the transformations whose inner update is being traced (outermost first)."""

  def __init__(self):
    self.stack: list[tuple[str, tuple]] = []


_ENCLOSING = _Enclosing()


@contextlib.contextmanager
def enclosing(what: str, options: dict) -> Iterator[None]:
  """Marks an inner transformation `what` and its `options`, which pre-flight checks compare.

  Example:
    >>> with enclosing("accumulate_gradients", {"every_k": 4}):
    ...   enclosing_options()
    (('accumulate_gradients', (('every_k', 4),)),)
  """
  _ENCLOSING.stack.append((what, tuple(sorted(options.items()))))
  try:
    yield
  finally:
    _ENCLOSING.stack.pop()


def enclosing_options() -> tuple:
  """The open `enclosing` blocks' ``(what, options)``, outermost first.

  Example:
    >>> enclosing_options()
    ()
  """
  return tuple(_ENCLOSING.stack)


class _FirstDevice(threading.local):
  depth = 0


_FIRST_DEVICE = _FirstDevice()


@contextlib.contextmanager
def state_from_first_device() -> Iterator[None]:
  """Marks a step whose outputs come from the first local device (``xla``, several devices).

  Example:
    >>> with state_from_first_device():
    ...   per_device_state_kept()
    False
  """
  _FIRST_DEVICE.depth += 1
  try:
    yield
  finally:
    _FIRST_DEVICE.depth -= 1


def per_device_state_kept() -> bool:
  """False while a step is traced inside `state_from_first_device`.

  Example:
    >>> per_device_state_kept()
    True
  """
  return _FIRST_DEVICE.depth == 0
