"""Every private JAX and mpi4jax API mnjax relies on, with its use and public replacement."""

from __future__ import annotations

import sys as _sys

# JAX's traces (`mnjax.functions`' chain). Public: none in jax 0.10.2 (opaque: equality only).
from jax._src import core as _jax_core

# JAX's effect registry: keeps an unused exchange, in ``custom_vjp`` too. Public: none in 0.10.2.
from jax._src import effects as _jax_effects

# Whether JAX started its backends. Public: none in jax 0.10.2 (jax.extend's queries start them).
from jax._src import xla_bridge as _jax_xla_bridge

# JAX's tracing entry points: the function object a staging trace traces (`traced_function`).
# Public: none in jax 0.10.2 (``DebugInfo`` names the function by source location only).
from jax._src.interpreters import partial_eval as _jax_pe

# mpi4jax's CUDA copy-mode flag and switch. Public replacement: none in mpi4jax 0.9.1.
from mpi4jax._src import decorators as _mpi4jax_decorators
from mpi4jax._src import xla_bridge as _mpi4jax_xla_bridge

# mpi4jax's FFI token (jax checks identity). Public: ``jax.ffi.abstract_token`` (jax >= 0.11).
from mpi4jax._src.jax_compat import abstract_token

# MPI handles as the FFI handlers' int64s. Public: none (``MPI._handleof``: private, no sign fix).
from mpi4jax._src.utils import to_dtype_handle, to_mpi_handle

__all__ = [
  "KEPT_EFFECT_BASE",
  "abstract_token",
  "jax_backends_started",
  "outermost_trace",
  "reachable_here",
  "register_kept_effect",
  "set_mpi4jax_cuda_copy_mode",
  "to_dtype_handle",
  "to_mpi_handle",
  "traced_for",
  "traced_function",
  "usable_here",
]


def jax_backends_started() -> bool:
  """Whether JAX has created its backends (opened its devices) in this process.

  Example:
    >>> _ = jax.devices()          # anything that asks for devices starts them
    >>> jax_backends_started()
    True
  """
  return _jax_xla_bridge.backends_are_initialized()


def set_mpi4jax_cuda_copy_mode(copy_to_host: bool) -> None:
  """Sets mpi4jax's CUDA copy mode: through host memory, or device pointers (CUDA-aware MPI).

  Example:
    >>> set_mpi4jax_cuda_copy_mode(copy_to_host=True)  # the mpich wheel  # doctest: +SKIP
  """
  _mpi4jax_decorators._cuda_mpi_setup_done = True  # mnjax decided: mpi4jax must not warn
  _mpi4jax_xla_bridge.mpi_xla_bridge_cuda.set_copy_to_host(copy_to_host)


def usable_here(value):
  """`value` if usable here, else its primal (of a finished ``jax.grad``) if usable, else None.

  Example:
    >>> usable_here(jnp.ones(2)).shape
    (2,)
  """
  while value is not None:
    if reachable_here(value):
      return value
    value = getattr(value, "primal", None)  # JVPTracer / LinearizeTracer
  return None


def _enclosing_traces():
  """The current trace and those enclosing it, innermost first."""
  trace = _jax_core.trace_ctx.trace
  while trace is not None:
    yield trace
    trace = getattr(trace, "parent_trace", None)


def _staging(trace) -> bool:
  """Whether `trace` stages a jaxpr (not eager evaluation or an eager transformation)."""
  return getattr(trace, "frame", None) is not None  # a DynamicJaxprTrace's jaxpr being built


def outermost_trace():
  """The outermost staging trace enclosing the current one (``f``'s in ``jax.jit(f)``), or None.

  Example:
    >>> outermost_trace() is None
    True
  """
  top = None
  for trace in _enclosing_traces():
    if _staging(trace):
      top = trace
  return top


def traced_for() -> tuple[str, ...]:
  """What each enclosing staged trace traces, innermost first (``"jit"``, ``"cond"``, ...).

  Example:
    >>> jax.jit(lambda x: (print(traced_for()), x)[1])(1.0)    # doctest: +SKIP
    ('jit',)
  """
  infos = (getattr(getattr(t, "frame", None), "debug_info", None) for t in _enclosing_traces())
  return tuple(str(info.traced_for) for info in infos if info is not None)


#: JAX's functions that trace a function into a jaxpr (file, name), each with a local
#: ``trace`` (the staging trace) and ``fun`` (the function, or a ``WrappedFun`` holding it).
_TRACERS = {(_jax_pe.__file__, name) for name in ("trace_to_jaxpr", "trace_to_jaxpr_dynamic")}


def traced_function(trace):
  """The Python function `trace` (a staging trace) traces, or None where JAX's frame is not found.

  Two closures of one factory have one source location but are two functions: this tells
  them apart (read from JAX's ``trace_to_jaxpr_dynamic`` frame on the stack).

  Example:
    >>> def step(x):
    ...   assert traced_function(outermost_trace()) is step
    ...   return x
    >>> float(jax.jit(step)(1.0))
    1.0
  """
  frame = _sys._getframe(1)
  while frame is not None:
    code = frame.f_code
    if (code.co_filename, code.co_name) in _TRACERS and frame.f_locals.get("trace") is trace:
      fun = frame.f_locals.get("fun")
      return fun.f if hasattr(fun, "call_wrapped") else fun
    frame = frame.f_back
  return None


def register_kept_effect(effect_type: type, *, control_flow: bool = False) -> object:
  """An `effect_type()` JAX keeps and lowers, in ``custom_vjp`` too (and, if `control_flow`, loops).

  Example:
    >>> effect = register_kept_effect(KEPT_EFFECT_BASE)          # doctest: +SKIP
  """
  _jax_effects.lowerable_effects.add_type(effect_type)
  _jax_effects.custom_derivatives_allowed_effects.add_type(effect_type)
  if control_flow:
    _jax_effects.control_flow_allowed_effects.add_type(effect_type)
    _jax_effects.remat_allowed_effects.add_type(effect_type)
  return effect_type()


#: The base class of JAX effects (for `register_kept_effect`).
KEPT_EFFECT_BASE = _jax_effects.Effect


def reachable_here(value) -> bool:
  """Whether the current trace may use `value` (concrete, or a live tracer of an enclosing one).

  Example:
    >>> reachable_here(jnp.ones(3))
    True
    >>> def step(x):
    ...   assert reachable_here(x)                         # a tracer of this very trace
    ...   return x
    >>> float(jax.jit(step)(1.0))
    1.0
  """
  if not isinstance(value, _jax_core.Tracer):
    return True
  own = value._trace
  if not own.is_valid():
    return False
  return any(trace is own for trace in _enclosing_traces())
