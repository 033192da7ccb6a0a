"""Every private JAX and mpi4jax API mnjax relies on, in one place.

mnjax pins jax and mpi4jax (pyproject.toml: mpi4jax==0.9.1.post2, which pins
``jaxlib<=0.10.2``), and a few things it needs have no public API in those versions. Each is
imported here, and only here, with what it is for and what would replace it, so that an
upgrade is one file to read (mpi4jax does the same in its ``_src/jax_compat.py``). The
other modules import these names from `mnjax.comm._compat`; nothing else in the package
imports ``jax._src`` or ``mpi4jax._src``.

Former private uses that now have a public home (and no longer come through here):
``jax._src.core.get_opaque_trace_state`` is ``jax.extend.core.get_opaque_trace_state``
(`mnjax.nn.SyncBatchNorm`'s order chain), and ``mpi4jax._src.xla_bridge.HAS_CUDA_EXT`` is
``mpi4jax.has_cuda_support()``.
"""

from __future__ import annotations

# The trace being traced into and the traces enclosing it (``parent_trace``), and a tracer's
# own trace: `mnjax.functions` orders its exchanges through a chain value that the next
# exchange can only use if it belongs to its trace or an enclosing one (the step's own
# trace, seen from under ``jax.grad`` inside it; not a finished ``lax.scan`` body).
# Public replacement: none in jax 0.10.2 (``jax.extend.core.get_opaque_trace_state`` is
# opaque: equality only).
from jax._src import core as _jax_core

# JAX's effect registry: an `mnjax.functions` exchange declares an effect of its own so that
# JAX keeps it when nothing uses its result (a forward-only send, a delegate left out of the
# loss) and lowers it; it must be allowed inside ``custom_vjp`` (mpi4jax registers its
# ordered effect the same way, in its ``_src/jax_compat.py``). Public replacement: none in
# jax 0.10.2.
from jax._src import effects as _jax_effects

# jax's "have the backends been created yet" flag: `create_communicator` must know whether
# JAX already started (then it is too late to choose devices, or to start jax.distributed)
# without starting it. Public replacement: none in jax 0.10.2 (every jax.extend.backend
# query creates the backends).
from jax._src import xla_bridge as _jax_xla_bridge

# mpi4jax's "CUDA copy mode chosen" flag and its CUDA extension's copy-mode switch, for
# `set_mpi4jax_cuda_copy_mode` (read at call time, so a test may patch them). Public
# replacement: none in mpi4jax 0.9.1 (only the MPI4JAX_USE_CUDA_MPI variable, read late).
from mpi4jax._src import decorators as _mpi4jax_decorators
from mpi4jax._src import xla_bridge as _mpi4jax_xla_bridge

# The abstract token value mpi4jax's FFI handlers take and return: the GPU lowering of
# `mnjax.comm._primitives` builds their operand and result types from it. jax must see its
# own singleton (it checks ``aval is core.abstract_token``), which mpi4jax picks per jax
# version. Public replacement: ``jax.ffi.abstract_token`` (jax >= 0.11).
from mpi4jax._src.jax_compat import abstract_token

# The C handles of an MPI object (communicator, reduction op, datatype) as the signed 64-bit
# integers mpi4jax's and mnjax's FFI handlers read, and of the MPI datatype of a numpy dtype.
# Public replacement: none in mpi4jax; mpi4py offers ``MPI._handleof`` (private as well) and
# nothing for the sign conversion MPICH's 32-bit handles need.
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
  """Sets how mpi4jax's CUDA handlers hand buffers to MPI, and marks its set-up as done.

  True: copy every buffer to host memory and back around the MPI call (any MPI); False:
  pass device pointers (a CUDA-aware MPI only). mpi4jax otherwise decides at its first GPU
  call from ``MPI4JAX_USE_CUDA_MPI``, with a warning that pytest's ``-W error`` turns into
  an error before the mode is set (`mnjax.comm._cuda_mpi` says why that segfaults). Needs
  mpi4jax's CUDA extension (``mpi4jax.has_cuda_support()``).

  Example:
    >>> set_mpi4jax_cuda_copy_mode(copy_to_host=True)  # the mpich wheel  # doctest: +SKIP
  """
  _mpi4jax_decorators._cuda_mpi_setup_done = True  # mnjax decided: mpi4jax must not warn
  _mpi4jax_xla_bridge.mpi_xla_bridge_cuda.set_copy_to_host(copy_to_host)


def usable_here(value):
  """`value` if the trace JAX traces into now may use it (`reachable_here`); else, for a
  tracer of a finished ``jax.grad``/``jax.vjp`` trace, its primal value when that one is
  usable (the same result, seen from the enclosing trace); else None.

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
  """The trace JAX traces into now and those enclosing it (``parent_trace``), innermost first."""
  trace = _jax_core.trace_ctx.trace
  while trace is not None:
    yield trace
    trace = getattr(trace, "parent_trace", None)


def _staging(trace) -> bool:
  """Whether `trace` stages a jaxpr (``jax.jit``'s, a body's, a ``custom_vjp``'s trace), not
  one that computes as it goes (eager evaluation, eager ``jax.grad``/``jvp``/``vmap``)."""
  return getattr(trace, "frame", None) is not None  # a DynamicJaxprTrace's jaxpr being built


def outermost_trace():
  """The outermost staging trace enclosing the one JAX traces into now (following
  ``parent_trace``), or None outside any (eagerly, also under an eager ``jax.grad``, ``jvp``
  or ``vmap``): under ``jax.jit(f)``, ``f``'s own trace, also seen from under a ``jax.grad``
  inside it.

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
  """What each staged trace enclosing the current one traces (innermost first): ``"jit"``,
  ``"cond"``, ``"while_body"``, ``"scan"``, ``"checkpoint / remat"``, ...

  Example:
    >>> jax.jit(lambda x: (print(traced_for()), x)[1])(1.0)    # doctest: +SKIP
    ('jit',)
  """
  infos = (getattr(getattr(t, "frame", None), "debug_info", None) for t in _enclosing_traces())
  return tuple(str(info.traced_for) for info in infos if info is not None)


def register_kept_effect(effect_type: type, *, control_flow: bool = False) -> object:
  """An instance of `effect_type` (a subclass of JAX's ``Effect``), registered as an unordered
  effect that JAX keeps and lowers, allowed inside ``custom_vjp`` (and, with
  `control_flow`, inside ``lax.cond``/``while_loop``/``scan`` bodies and ``jax.checkpoint``,
  also under ``jax.grad``: a refused call's stand-in, whose check names the refusal).

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
  """Whether the trace JAX traces into now may use `value`: a concrete array, or a tracer of
  this trace or of one enclosing it (whose trace has not finished).

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
