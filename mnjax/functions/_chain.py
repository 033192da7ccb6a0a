"""How `mnjax.functions` orders its exchanges (an ``after`` operand) and gives them a backward
(an `anchor`); docs/design/functions.md.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mnjax.comm._instep import _sequence as sequence
from mnjax.functions import _checks as checks
from mnjax.functions import _trace_check as trace_check

__all__ = ["anchor", "apply", "differentiable", "link", "put", "scalar"]


def scalar(value: Any) -> jax.Array:
  """A float32 scalar computed from `value` (an exchange's result): the next ``after``.

  Example:
    >>> float(scalar(jnp.arange(3, 6)))
    3.0
  """
  value = jnp.asarray(value)
  if value.size == 0:
    return jnp.zeros((), jnp.float32)
  first = jnp.ravel(value)[0]
  return (first.real if jnp.iscomplexobj(first) else first).astype(jnp.float32)


class _Mine(threading.local):
  """The last link an exchange of `mnjax.functions` put, and its recording."""

  value: Any = None
  log: Any = None


_MINE = _Mine()

GAP = (
    "mnjax.functions: an exchange of this step was traced inside a trace that ended before"
    " the next one and that no other check refuses (e.g. a custom transformation's trace),"
    " so nothing can order the next exchange after it. " + trace_check.HINT)


def _last(comm: Any) -> jax.Array | None:
  """The usable last link; a gap left by an exchange of this step is refused (`GAP`)."""
  last = sequence.ORDER.reachable()
  log = _log()
  if (last is None and _MINE.value is not None and sequence.ORDER.stale() is _MINE.value
      and log is not None and _MINE.log is log):
    _MINE.value = None  # refused once
    checks.refuse(GAP, comm)
  return last


def link(comm: Any = None) -> jax.Array:
  """The ``after`` operand of the next forward exchange (never differentiated).

  Example:
    >>> link().shape, link().dtype
    ((), dtype('float32'))
  """
  last = _last(comm)
  return jax.lax.stop_gradient(scalar(last if last is not None else 0.0))


def put(value: Any) -> None:
  """Makes `value` the chain's last link (the next collective of the step waits for it)."""
  sequence.ORDER.put(value)
  _MINE.value, _MINE.log = value, _log()


def _log() -> Any:
  """`mnjax.functions.jit`'s recording, else the plain ``jax.jit`` step's `StepCheck`."""
  log = sequence.current_recording()
  return log if log is not None else trace_check.current()


def anchor() -> jax.Array:
  """A float32 zero that ``jax.grad`` gives a tangent of its own (a ``jax.new_ref`` read).

  Example:
    >>> float(anchor())
    0.0
  """
  return jax.new_ref(jnp.zeros((), jnp.float32))[...]


def differentiable(forward: Callable, backward: Callable, x: Any, comm: Any = None) -> Any:
  """``forward(x, after)``, with ``backward(ct, after) -> (ct_x, done)`` as its derivative.

  Example:
    >>> double = lambda x, after: 2 * x
    >>> twice_back = lambda ct, after: (2 * ct, ct)
    >>> float(jax.grad(lambda x: differentiable(double, twice_back, x))(1.0))
    2.0
  """
  after = link(comm)
  with trace_check.ambient():
    y, out = _exchange(forward, backward, x, after, anchor())
  put(out)
  return y


def apply(forward: Callable, backward: Callable, x: Any, dtype: Any, comm: Any = None,
          caller: str = "exchange") -> Any:
  """`differentiable` for an inexact `dtype`, else `forward` alone; a misplaced call is refused.

  Example:
    >>> int(apply(lambda x, after: x + 1, None, jnp.int32(1), jnp.int32))
    2
  """
  problem = checks.misplaced(caller)
  if problem is not None:  # refused on every rank by the check; the step never runs
    checks.refuse(problem, comm)
    return checks.stand_in(forward, x, jnp.zeros((), jnp.float32))
  if jnp.issubdtype(dtype, jnp.inexact):
    return differentiable(forward, backward, x, comm)
  y = forward(x, link(comm))
  put(y)
  return y


def _forward(forward, x, after):
  y = forward(x, after)
  return y, scalar(y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exchange(forward, backward, x, after, token):
  del backward, token
  return _forward(forward, x, after)


def _exchange_fwd(forward, backward, x, after, token):
  del backward, token
  y, out = _forward(forward, x, after)
  return (y, out), out


def _exchange_bwd(forward, backward, out, cotangents):
  del forward
  ct_y, _ = cotangents
  last = sequence.ORDER.reachable()  # the backward exchange traced before this one
  after = out if last is None else out + 0 * scalar(last)
  ct_x, done = backward(ct_y, after)
  put(done)
  zero = jnp.zeros((), jnp.float32)
  return ct_x, zero, zero


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
