"""The step's program, compared across ranks: every rank must run the same computation.

`program_of` makes a jaxpr canonical (arguments by shape and dtype; MPI handles, addresses and
sources left out), `check_same_program` compares its hash once per trace, `user_collectives`
finds collectives mnjax did not write. Design: docs/design/failures.md, "The program check"."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from mnjax.comm._communicator import Communicator
from mnjax.comm._host._agreement import gather_if_different, group_note

__all__ = ["Program", "check_same_program", "describe_programs", "program_of",
           "rank_dependent", "user_collectives"]

_JAX_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, np) if m.__file__)
_MNJAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: Parameters that name an MPI communicator by its handle (a per-rank number).
_PER_RANK_PARAMS = frozenset({"comm_handle", "comm", "comm_ptr"})
_SMALL = 8  # constants with at most this many elements are shown by value
#: The `jax.named_scope` of `rank_dependent`.
RANK_DEPENDENT_SCOPE = "mnjax_rank_dependent"


def rank_dependent():
  """A scope whose operations may differ per rank in their constants (compared by operation
  and shapes only); an array closed over is still compared: pass it as an argument.

  Example:
    >>> def step(x):
    ...   with mnjax.guard.rank_dependent():
    ...     return x * (1.0 + comm.rank)          # another literal on every rank, on purpose
    >>> float(mnjax.data_parallel(step, comm, batch_argnums=())(jnp.ones(()))) == 1.0 + comm.rank
    True
  """
  return jax.named_scope(RANK_DEPENDENT_SCOPE)


class Op(NamedTuple):
  """One operation of a program, canonically: compared across ranks field by field."""

  depth: int  # nesting: 0 for the step, 1 inside a cond branch or scan body, ...
  primitive: str  # "mul", or "argument" / "constant" for the program's inputs
  params: tuple[tuple[str, str], ...]
  operands: tuple[str, ...]
  results: tuple[str, ...]


class Program(NamedTuple):
  """A program's operations and, for messages only, where each comes from."""

  ops: tuple[Op, ...]
  where: tuple[str, ...]

  def digest(self) -> str:
    """A hash of `ops` (`where` is not part of it).

    Example:
      >>> closed = jax.make_jaxpr(lambda x: x * 0.5)(jnp.ones(3))
      >>> len(program_of(closed).digest())
      32
    """
    return hashlib.blake2b(repr(self.ops).encode(), digest_size=16).hexdigest()


def program_of(closed: jcore.ClosedJaxpr, arg_paths: list[str] | None = None, *,
               sources: bool = False) -> Program:
  """The canonical `Program` of a closed jaxpr (`jax.make_jaxpr`'s result). For messages:
  `arg_paths` names each input (``"argument 1 ['images']"``), `sources` fills `Program.where`.

  Example:
    >>> closed = jax.make_jaxpr(lambda x: x * 0.5 + 1.0)(jnp.ones(3))
    >>> [op.primitive for op in program_of(closed).ops]
    ['argument', 'mul', 'add', 'return']
    >>> program_of(closed).ops[1].operands
    ('v0:f32[3]', 'literal 0.5:f32[]')
  """
  ops: list[Op] = []
  where: list[str] = []
  names: dict[Any, str] = {}
  for i, (var, value) in enumerate(zip(closed.jaxpr.constvars, closed.consts)):
    names[var] = f"c{i}:{_aval(var.aval)}"
    ops.append(Op(0, "constant", (), (), (f"{names[var]} = {_value(value)}",)))
    where.append(f"(constant {i} of the program, e.g. an array the function closes over)")
  for i, var in enumerate(closed.jaxpr.invars):
    names[var] = f"v{i}:{_aval(var.aval)}"
    ops.append(Op(0, "argument", (), (), (names[var],)))
    where.append(f"({arg_paths[i]})" if arg_paths and i < len(arg_paths) else f"(input {i})")
  _walk(closed.jaxpr, 0, names, ops, where if sources else None)
  ops.append(Op(0, "return", (), tuple(_operand(v, names) for v in closed.jaxpr.outvars), ()))
  where.append("(the outputs)")
  return Program(tuple(ops), tuple(where) if sources else ())


def _walk(jaxpr: Any, depth: int, names: dict, ops: list, where: list | None) -> None:
  for eqn in jaxpr.eqns:
    params, subs = [], []
    per_rank = RANK_DEPENDENT_SCOPE in str(eqn.source_info.name_stack)
    for key in sorted(eqn.params):
      value = eqn.params[key]
      found = jaxprs_in(value)
      if found:
        subs.extend(found)
        params.append((key, f"<{len(found)} program(s), below>"))
      elif key in _PER_RANK_PARAMS:
        params.append((key, "<this rank's communicator>"))
      elif per_rank:
        params.append((key, "<rank-dependent>"))
      else:
        params.append((key, _param(value)))
    operands = tuple(_operand(v, names, per_rank) for v in eqn.invars)
    for var in eqn.outvars:
      names[var] = f"v{len(names)}:{_aval(var.aval)}"
    ops.append(Op(depth, eqn.primitive.name, tuple(params), operands,
                  tuple(names.get(v, "_") for v in eqn.outvars)))
    if where is not None:
      where.append(_where(eqn))
    for sub in subs:
      inner = open_jaxpr(sub)
      sub_names = dict(names)
      if isinstance(sub, jcore.ClosedJaxpr):
        for i, (var, value) in enumerate(zip(inner.constvars, sub.consts)):
          sub_names[var] = f"c{depth + 1}.{i}={_value(value)}"
      for i, var in enumerate(inner.invars):
        sub_names[var] = f"in{i}:{_aval(var.aval)}"
      _walk(inner, depth + 1, sub_names, ops, where)


def jaxprs_in(value: Any) -> list[Any]:
  """The jaxprs in a parameter value (a jaxpr, or a tuple of them: ``cond``'s branches).

  Example:
    >>> closed = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
    >>> len(jaxprs_in(closed.jaxpr.eqns[-1].params["branches"]))
    2
  """
  items = value if isinstance(value, (tuple, list)) else (value,)
  return [v for v in items if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]


def open_jaxpr(program: Any) -> Any:
  """The open `Jaxpr` of a closed or open one.

  Example:
    >>> closed = jax.make_jaxpr(jnp.sin)(1.0)
    >>> open_jaxpr(closed) is closed.jaxpr
    True
  """
  return program.jaxpr if isinstance(program, jcore.ClosedJaxpr) else program


def axes_of(value: Any) -> tuple:
  """A collective's axis parameter as a tuple of names (a name, a tuple of them, or None).

  Example:
    >>> axes_of("batch"), axes_of(("a", "b")), axes_of(None)
    (('batch',), ('a', 'b'), ())
  """
  if value is None:
    return ()
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _aval(aval: Any) -> str:
  try:
    return aval.str_short(short_dtypes=True)
  except (AttributeError, TypeError):
    return str(aval)


def _operand(var: Any, names: dict, per_rank: bool = False) -> str:
  if isinstance(var, jcore.Literal):
    return f"literal {'<rank-dependent>' if per_rank else _value(var.val)}:{_aval(var.aval)}"
  return names.get(var, f"outer:{_aval(var.aval)}")


def _value(value: Any) -> str:
  """An array's value as text (small ones in full, others as a hash of their bytes)."""
  if isinstance(value, jax.core.Tracer):
    return f"<a traced value {_aval(value.aval)}>"
  try:
    array = np.asarray(value)
  except Exception:  # noqa: BLE001 - an opaque constant (e.g. a PRNG key type)
    return _param(value)
  if array.dtype == object:
    return _param(value)
  if array.size <= _SMALL:
    return np.array2string(array, separator=", ") if array.ndim else str(array)
  digest = hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=8).hexdigest()
  return f"{array.dtype}{list(array.shape)} with bytes hashing to {digest}"


def _param(value: Any) -> str:
  """A parameter as text that is the same on every rank for the same meaning."""
  if isinstance(value, (np.ndarray, jax.Array)):
    return _value(value)
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(_param(v) for v in value) + ")"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k!r}: {_param(v)}" for k, v in sorted(value.items())) + "}"
  if callable(value) and hasattr(value, "__qualname__"):
    return f"<function {getattr(value, '__module__', '')}.{value.__qualname__}>"
  text = _ADDRESS.sub("", repr(value))
  return text if len(text) <= 300 else text[:300] + "..."


def _frames(eqn: Any) -> list[Any]:
  """The frames of `eqn`'s traceback outside JAX and numpy, innermost first."""
  traceback = eqn.source_info.traceback
  if traceback is None:
    return []
  return [f for f in traceback.frames if not f.file_name.startswith(_JAX_DIRS)]


def _where(eqn: Any) -> str:
  """The innermost two frames and the innermost one of the user's own code, as text."""
  frames = _frames(eqn)
  if not frames:
    return ""
  own = [f for f in frames if not _installed(f.file_name)
         and not f.file_name.startswith(_MNJAX_DIR)]
  shown = frames[:2] + own[:1]
  seen, parts = set(), []
  for f in shown:
    text = f"{_short(f.file_name)}:{f.line_num} ({f.function_name})"
    if text not in seen:
      seen.add(text)
      parts.append(text)
  return "from " + ", ".join(parts)


_PACKAGES = ("site-packages" + os.sep, "dist-packages" + os.sep)


def _installed(path: str) -> bool:
  return any(marker in path for marker in _PACKAGES)


def _short(path: str) -> str:
  for marker in _PACKAGES:
    if marker in path:
      return path.split(marker, 1)[1]
  try:
    rel = os.path.relpath(path)
  except ValueError:
    return path
  return path if rel.startswith("..") else rel


def check_same_program(comm: Communicator, closed: jcore.ClosedJaxpr, *, caller: str,
                       what: str = "the step", arg_paths: list[str] | None = None,
                       fix: str = "") -> None:
  """Raises the same `ValueError` on every rank unless every rank traced an equal program.
  Collective: one allgather of a hash; the programs travel only on a mismatch.

  Example:
    >>> closed = jax.make_jaxpr(lambda x: x * 0.5)(jnp.ones(3))
    >>> check_same_program(comm, closed, caller="data_parallel")  # the same on every rank
  """
  if comm.size == 1:
    return
  digest = program_of(closed, arg_paths).digest()
  if gather_if_different(comm, f"{caller}'s program check", digest,
                         what=f"{caller}'s check of {what}") is None:
    return
  programs = comm.mpi_comm.allgather(program_of(closed, arg_paths, sources=True))
  raise ValueError(describe_programs(programs, caller=caller, what=what, fix=fix)
                   + group_note(comm.mpi_comm))


def describe_programs(programs: list[Program], *, caller: str, what: str = "the step",
                      fix: str = "") -> str:
  """The message for ranks whose program differs from rank 0's (the same text on every rank).

  Example:
    >>> a = program_of(jax.make_jaxpr(lambda x: x * 0.01)(jnp.ones(3)), sources=True)
    >>> b = program_of(jax.make_jaxpr(lambda x: x * 0.1)(jnp.ones(3)), sources=True)
    >>> "literal 0.01:f32[] on rank 0, literal 0.1:f32[] on rank 1" in describe_programs(
    ...     [a, b], caller="data_parallel")
    True
  """
  ref = programs[0]
  details = []
  for rank, program in enumerate(programs):
    if program.ops == ref.ops:
      continue
    i = next((i for i, (a, b) in enumerate(zip(program.ops, ref.ops)) if a != b),
             min(len(program.ops), len(ref.ops)))
    details.append(f"rank {rank} differs from rank 0 at operation {i + 1} (of"
                   f" {len(ref.ops)} on rank 0, {len(program.ops)} on rank {rank}): "
                   + _difference(ref, program, i, rank))
    if len(details) == 3:
      break
  return (
      f"{caller}: the ranks traced different programs for {what}, so each would run its own"
      " computation on values that must stay identical (e.g. each applying its own learning"
      " rate, or waiting in a collective the others never issue). " + "; ".join(details)
      + ". Build it identically on every rank (the same hyperparameters, schedules,"
      " accumulation periods and constants); pass a value that must differ per rank as an"
      " argument of the step (arguments are compared by shape and dtype only)"
      + (f"; {fix}" if fix else "") + ". Nothing was run.")


def _difference(ref: Program, other: Program, i: int, rank: int) -> str:
  if i >= len(other.ops):
    return (f"rank {rank}'s program ends there, rank 0's goes on with `{ref.ops[i].primitive}`"
            f" {ref.where[i]}")
  if i >= len(ref.ops):
    return (f"rank 0's program ends there, rank {rank}'s goes on with"
            f" `{other.ops[i].primitive}` {other.where[i]}")
  a, b = ref.ops[i], other.ops[i]
  head = f"`{a.primitive}` {ref.where[i]}".rstrip() + ": "  # rank 0's source names it
  if a.primitive != b.primitive:
    return head + f"the operation is `{a.primitive}` on rank 0, `{b.primitive}` on rank {rank}"
  if a.primitive in ("argument", "constant") and a.results != b.results:
    return head + f"it is {a.results[0]} on rank 0, {b.results[0]} on rank {rank}"
  for (key, x), (_, y) in zip(a.params, b.params):
    if x != y:
      return head + f"its parameter {key} is {x} on rank 0, {y} on rank {rank}"
  if a.params != b.params:
    return head + f"its parameters are {dict(a.params)} on rank 0, {dict(b.params)} on rank {rank}"
  for j, (x, y) in enumerate(zip(a.operands, b.operands)):
    if x != y:
      return head + f"its operand {j + 1} is {x} on rank 0, {y} on rank {rank}"
  if a.operands != b.operands:
    return head + f"it has {len(a.operands)} operands on rank 0, {len(b.operands)} on rank {rank}"
  return head + (f"its results are {', '.join(a.results)} on rank 0,"
                 f" {', '.join(b.results)} on rank {rank}")


#: Collectives over a named axis and the parameter that names their axes.
_AXIS_PARAMS = {"psum": "axes", "pmax": "axes", "pmin": "axes", "all_gather": "axis_name",
                "all_to_all": "axis_name", "ppermute": "axis_name",
                "reduce_scatter": "axis_name", "axis_index": "axis_name",
                "pbroadcast": "axis_name", "psum_invariant": "axes"}


def user_collectives(closed: jcore.ClosedJaxpr, axis_name: str, *,
                     allowed_scope: str) -> list[str]:
  """Collectives over `axis_name` that user code (not mnjax) traced outside the
  ``jax.named_scope(allowed_scope)``, each with its source.

  Example:
    >>> closed = jax.make_jaxpr(lambda x: jax.lax.psum(x, "i"), axis_env=[("i", 2)])(1.0)
    >>> [d.split(" ")[0] for d in user_collectives(closed, "i", allowed_scope="local")]
    ['psum']
  """
  found: list[str] = []
  _scan_collectives(closed.jaxpr, axis_name, allowed_scope, found)
  return found


def _scan_collectives(jaxpr: Any, axis_name: str, allowed_scope: str, found: list) -> None:
  for eqn in jaxpr.eqns:
    key = _AXIS_PARAMS.get(eqn.primitive.name)
    if key is not None:
      axes = axes_of(eqn.params.get(key))
      frames = _frames(eqn)
      ours = bool(frames) and frames[0].file_name.startswith(_MNJAX_DIR)
      scoped = allowed_scope in str(eqn.source_info.name_stack)
      if axis_name in axes and not ours and not scoped:
        found.append(f"{eqn.primitive.name} over {axis_name!r} {_where(eqn)}".rstrip())
    for value in eqn.params.values():
      for sub in jaxprs_in(value):
        _scan_collectives(open_jaxpr(sub), axis_name, allowed_scope, found)
