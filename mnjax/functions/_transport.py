"""`issue`: where `mnjax.functions` notes and binds an MPI exchange inside a traced step."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import ffi
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from mpi4py import MPI

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _native as native
from mnjax.comm._instep import _primitives as mpi_ops
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep._compat import (
  KEPT_EFFECT_BASE,
  outermost_trace,
  register_kept_effect,
  to_mpi_handle,
)
from mnjax.functions import _trace_check as trace_check
from mnjax.guard import _pairing as pairing

__all__ = ["OUTSIDE", "ExchangeEffect", "check_only", "dry", "exchange_p", "issue", "peer_world",
           "record", "take_part", "world_group"]


class ExchangeEffect(KEPT_EFFECT_BASE):
  """An exchange's effect: kept by JAX's dead-code elimination; unordered."""

  def __repr__(self):  # JAX names it when it refuses it (inside vmap's or a body's rules)
    return "mnjax.functions exchange (call it at the step's top level or under jax.grad)"


class _CheckEffect(KEPT_EFFECT_BASE):
  """The effect of a refused call's stand-in (`check_only`): allowed in control flow."""


#: The error of an exchange outside any jitted step (nothing could check it).
OUTSIDE = (
    "{label}: called outside any traced step (eagerly, also under an eager jax.grad, jax.jvp"
    " or jax.vmap, or in the backward of a jax.vjp called outside jax.jit); the exchanges"
    " run inside a jitted step, whose pairing is checked across ranks before it runs. Call"
    " it inside jax.jit (or mnjax.functions.jit(step, comm)) on every rank.")

_EFFECT = register_kept_effect(ExchangeEffect)
_CHECK_EFFECT = register_kept_effect(_CheckEffect, control_flow=True)

#: The attributes each handler reads besides ``count``, ``comm`` and ``dtype``.
_TARGETS = {
    "send": ("mnjax_mpi_send", ("peer", "tag")),
    "recv": ("mnjax_mpi_recv", ("peer", "tag")),
    "bcast": ("mnjax_mpi_bcast", ("root",)),
    "gather": ("mnjax_mpi_gather", ("root",)),
    "scatter": ("mnjax_mpi_scatter", ("root",)),
    "reduce": ("mnjax_mpi_reduce", ("root", "op")),
    "allgather": ("mnjax_mpi_allgather", ()),
    "alltoall": ("mnjax_mpi_alltoall", ()),
}


def world_group(comm: Communicator) -> tuple[int, ...]:
  """``MPI.COMM_WORLD`` ranks of `comm`'s ranks (what the pairing check compares).

  Example:
    >>> world_group(comm) == tuple(range(comm.size))
    True
  """
  return pairing.world_ranks(comm.mpi_comm)


def peer_world(comm: Communicator, rank: int) -> int:
  """The ``MPI.COMM_WORLD`` rank of `comm`'s rank `rank`.

  Example:
    >>> peer_world(comm, 0)
    0
  """
  return world_group(comm)[rank]


def issue(exchange: str, comm: Communicator, payload: Any, after: Any, *, shape: tuple,
          dtype: Any, count: int, label: str, note: tuple, wire: Any = None,
          **attrs: int) -> Any:
  """Notes and binds one exchange of `payload` (None for a receive), after `after`.

  `count`: items per message; `note`: ``(kind, peer, phase, shape, dtype)``.

  Example:
    >>> def gathered(x):                                          # a size-1 allgather
    ...   return mnjax.functions._transport.issue(
    ...       "allgather", comm, x, jnp.zeros(()), shape=(1, 3), dtype=x.dtype, count=3,
    ...       label="allgather", note=("collective", None, None, (3,), "float32"))
    >>> jax.jit(gathered)(jnp.ones(3)).shape
    (1, 3)
  """
  if _DRY.on:
    return jnp.zeros(shape, dtype)
  if outermost_trace() is None:
    raise RuntimeError(OUTSIDE.format(label=label))
  kind, peer, phase, note_shape, note_dtype = note
  check = record(
      comm, pairing.entry(label, kind, world_group(comm), phase=phase,
                          peer=None if peer is None else peer_world(comm, peer),
                          comm=comm.uid),
      note_shape, note_dtype)
  target, names = _TARGETS[exchange]
  operands = () if payload is None else (payload,)
  params = tuple((name, int(attrs[name])) for name in names)
  return exchange_p.bind(*operands, mpi_ops.after_operand(after), target=target,
                         comm_handle=int(to_mpi_handle(comm.device_comm)), attrs=params,
                         count=int(count), shape=tuple(int(d) for d in shape),
                         dtype=np.dtype(dtype), wire=np.dtype(dtype if wire is None else wire),
                         aliased=exchange == "bcast", check=check)


def record(comm: Communicator, what: str, shape: Any, dtype: Any) -> trace_check.StepCheck | None:
  """Notes one sequence entry; returns the plain ``jax.jit`` step's `StepCheck`, or None.

  Example:
    >>> record(comm, "mnjax.functions.send <mnjax.functions send peer=1 phase=forward"
    ...      " group=0,1>", (3,), "float32") is None          # doctest: +SKIP
    False
  """
  if sequence.recording_open():
    sequence.note_collective(what, shape, dtype)
    return None
  check = trace_check.current()
  check.note(comm, (what, tuple(int(d) for d in shape), str(dtype)))
  return check


class _Dry(threading.local):
  on = False


_DRY = _Dry()


@contextlib.contextmanager
def dry() -> Iterator[None]:
  """While the block runs, `issue` only returns zeros of the exchange's shape.

  Example:
    >>> with dry():
    ...   issue("allgather", comm, jnp.ones(3), None, shape=(1, 3), dtype=jnp.float32,
    ...         count=3, label="allgather", note=("collective", None, None, (3,), "float32"))
    Array([[0., 0., 0.]], dtype=float32)
  """
  _DRY.on = True
  try:
    yield
  finally:
    _DRY.on = False


def check_only(check: trace_check.StepCheck | None) -> None:
  """Makes the step's lowering run `check` (a refused call issues no exchange).

  Example:
    >>> check_only(None)
  """
  if check is not None:
    _check_p.bind(np.zeros((), np.float32), check=check)


def take_part(comm: Communicator) -> None:
  """Makes a plain ``jax.jit`` step that exchanges nothing join the pairing check over `comm`.

  Example:
    >>> take_part(comm)   # outside any traced step: nothing to do
  """
  if sequence.recording_open() or outermost_trace() is None:
    return
  check = trace_check.current()
  check.join(comm)
  check_only(check)


def _abstract(*operands, shape, dtype, **_):
  del operands
  return ShapedArray(shape, dtype), {_EFFECT}


def _in_own_function() -> bool:
  """Whether the op being lowered sits in the program's own function (``main``), not in a
  function it calls: a nested ``jax.jit``'s trace, which JAX may have cached from a call of
  its own and reused here without tracing its exchanges again."""
  try:
    op = mlir.ir.InsertionPoint.current.block.owner
    while op.operation.name != "func.func":
      op = op.parent
  except ValueError:  # no enclosing function to read: nothing to refuse
    return True
  return mlir.ir.StringAttr(op.attributes["sym_name"]).value == "main"


def _lower_cpu(ctx, *operands, target, comm_handle, attrs, count, shape, dtype, wire,
               aliased, check):
  del shape, dtype
  if check is not None:  # the pairing check of a plain jax.jit step: before it ever runs
    if not _in_own_function():
      check.refuse_reuse(target.removeprefix("mnjax_mpi_"))
    check.run()
  native.register()  # one registration for every handler
  kw = {"operand_output_aliases": {0: 0}} if aliased else {}
  lowering = ffi.ffi_lowering(target, has_side_effect=True, **kw)
  values = dict(attrs)
  if "op" in values:
    values["op"] = int(to_mpi_handle(MPI.SUM))
  attributes = {name: np.int64(v) for name, v in values.items()}
  return lowering(ctx, *operands, count=np.int64(count), comm=np.int64(comm_handle),
                  dtype=mpi_ops.mpi_datatype(wire), **attributes)


def _lower_gpu(ctx, *operands, **params):
  del ctx, operands
  raise NotImplementedError(
      f"mnjax.functions ({params['target']}): the in-step exchanges run on CPU devices (mnjax's"
      " native MPI handlers); on GPUs no handler orders a receive after the previous"
      " exchange. Run the model-parallel step on CPU devices, or exchange activations"
      " between steps with host collectives.")


def _no_differentiation(*args, **kwargs):
  raise NotImplementedError(
      "mnjax.functions' exchanges are differentiated through their own custom_vjp rules"
      " (mnjax.functions.send, recv, bcast, ...); the raw primitive has no derivative.")


def _eager(*operands, target="a refused call", **params):
  """Evaluation outside any staging trace: refused, as in `issue`."""
  del operands, params
  raise RuntimeError(OUTSIDE.format(label=f"mnjax.functions ({target})"))


def _lower_check(ctx, zero, *, check):
  del ctx
  check.run()
  return [zero]


exchange_p = Primitive("mnjax_exchange")
exchange_p.def_effectful_abstract_eval(_abstract)
exchange_p.def_impl(_eager)
_check_p = Primitive("mnjax_exchange_check")  # a refused call's stand-in: the check alone
_check_p.def_effectful_abstract_eval(
    lambda zero, **_: (ShapedArray((), np.float32), {_CHECK_EFFECT}))
_check_p.def_impl(_eager)
mlir.register_lowering(_check_p, _lower_check)
# Not cached across functions: `_in_own_function` reads where each exchange is lowered.
mlir.register_lowering(exchange_p, _lower_cpu, platform="cpu", cacheable=False)
mlir.register_lowering(exchange_p, _lower_gpu, platform="cuda")
ad.primitive_jvps[exchange_p] = _no_differentiation
