"""Which outputs of a per-device step may differ across devices (docs/design/multi_device.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from mnjax.guard._program import axes_of as _axes
from mnjax.guard._program import jaxprs_in as _programs
from mnjax.guard._program import open_jaxpr as _open

__all__ = ["varying_outputs"]

#: Collectives whose result is the same over the axes they reduce, and the parameter naming them.
_INVARIANT_OVER = {"psum": "axes", "pmax": "axes", "pmin": "axes", "psum_invariant": "axes",
                   "all_gather": "axis_name", "all_gather_invariant": "axis_name",
                   "pbroadcast": "axis_name"}
#: Parameters by which a primitive names the mapped axes it works over.
_AXIS_PARAMS = ("axes", "axis_name")
#: Primitives naming an axis that compute elementwise (``check_vma=True``'s type markers).
_MARKERS = frozenset({"pvary"})
#: Primitives whose results may differ with the same operands.
_IMPURE = frozenset({"io_callback"})
#: Primitives whose (closed) program takes the operands one to one and gives the results.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
          "shard_map": "jaxpr"}


def varying_outputs(closed_jaxpr: Any, varying_inputs: Sequence[bool],
                    axis_name: str) -> list[bool]:
  """For each output of a per-device jaxpr, whether it may differ across `axis_name`.

  Args:
    closed_jaxpr: the per-device program traced with `axis_name` bound, closed or open.
    varying_inputs: one bool per flattened input: True for the batch arguments' leaves.
    axis_name: the mapped axis (``comm.axis_name``).

  Example:
    >>> def step(w, x):                         # w replicated, x: this device's examples
    ...   loss = ((x * w) ** 2).mean()
    ...   return w - jax.lax.pmean(x.mean(), "batch"), loss, jax.lax.pmean(loss, "batch")
    >>> closed = jax.make_jaxpr(step, axis_env=[("batch", 2)])(1.0, jnp.ones(4))
    >>> varying_outputs(closed, [False, True], "batch")
    [False, True, False]
  """
  jaxpr = closed_jaxpr.jaxpr if isinstance(closed_jaxpr, jcore.ClosedJaxpr) else closed_jaxpr
  if not isinstance(jaxpr, jcore.Jaxpr):
    raise TypeError(f"varying_outputs: expected a ClosedJaxpr or Jaxpr (jax.make_jaxpr's"
                    f" result), got {type(closed_jaxpr).__name__}.")
  varying_inputs = [bool(v) for v in varying_inputs]
  if len(varying_inputs) != len(jaxpr.invars):
    raise ValueError(f"varying_outputs: the program has {len(jaxpr.invars)} inputs, but"
                     f" varying_inputs has {len(varying_inputs)} entries; pass one bool per"
                     " flattened argument leaf (jax.tree.leaves(args)), True for batch leaves.")
  if not isinstance(axis_name, str):
    raise TypeError(f"varying_outputs: axis_name must be a str, got {axis_name!r}.")
  return _Analysis(axis_name).run(jaxpr, [False] * len(jaxpr.constvars), varying_inputs)


class _Analysis:
  """One analysis over `axis`, with the results of nested programs memoised per input."""

  def __init__(self, axis: str):
    self.axis = axis
    self.memo: dict[tuple[int, tuple[bool, ...]], list[bool]] = {}
    self.keep: list[Any] = []  # the memo's jaxprs stay alive, so their ids stay theirs
    self.mentions: dict[int, bool] = {}

  def run(self, jaxpr: Any, consts: list[bool], inputs: list[bool]) -> list[bool]:
    key = (id(jaxpr), tuple(consts + inputs))
    if key not in self.memo:
      self.keep.append(jaxpr)
      env: dict[Any, bool] = dict(zip(jaxpr.constvars, consts))
      env.update(zip(jaxpr.invars, inputs))
      for eqn in jaxpr.eqns:
        ins = [self.read(env, v) for v in eqn.invars]
        for var, varying in zip(eqn.outvars, self.eqn(eqn, ins)):
          env[var] = varying
      self.memo[key] = [self.read(env, v) for v in jaxpr.outvars]
    return self.memo[key]

  def closed(self, program: Any, inputs: list[bool]) -> list[bool]:
    """A nested program (closed or open) on `inputs`; its own constants are invariant."""
    program = _open(program)
    return self.run(program, [False] * len(program.constvars), inputs)

  @staticmethod
  def read(env: dict, var: Any) -> bool:
    return False if isinstance(var, jcore.Literal) else env[var]

  def eqn(self, eqn: Any, ins: list[bool]) -> list[bool]:
    name, params, n = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name in _INVARIANT_OVER and self.axis in _axes(params.get(_INVARIANT_OVER[name])):
      if params.get("axis_index_groups") is None:
        return [False] * n
      return [True] * n  # each group reduces its own devices
    if name in _IMPURE:
      return [True] * n
    if name == "cond":
      if ins[0]:
        return [True] * n
      return [any(vs) for vs in zip(*(self.closed(b, ins[1:]) for b in params["branches"]))]
    if name == "while":
      return self.while_loop(params, ins)
    if name == "scan":
      return self.scan(params, ins, n)
    program = params.get(_CALLS.get(name, ""))
    if program is not None and len(_open(program).invars) == len(ins):
      return self.closed(program, ins)
    if name not in _MARKERS and any(self.axis in _axes(params.get(p)) for p in _AXIS_PARAMS):
      return [True] * n  # axis_index, ppermute, all_to_all, psum_scatter, ...
    nested = [p for value in params.values() for p in _programs(value)]
    if nested and any(self.mention(p) for p in nested):
      return [True] * n
    return [any(ins)] * n

  def while_loop(self, params: dict, ins: list[bool]) -> list[bool]:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    while True:
      out = self.closed(params["body_jaxpr"], body_consts + carry)
      new = [a or b for a, b in zip(carry, out)]
      if new == carry:
        break
      carry = new
    if any(self.closed(params["cond_jaxpr"], cond_consts + carry)):
      return [True] * len(carry)  # devices may stop after different numbers of iterations
    return carry

  def scan(self, params: dict, ins: list[bool], n: int) -> list[bool]:
    nc, ncarry = params["num_consts"], params["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    while True:
      out = self.closed(params["jaxpr"], consts + carry + xs)
      new = [a or b for a, b in zip(carry, out[:ncarry])]
      if new == carry:
        return carry + out[ncarry:]
      carry = new

  def mention(self, program: Any) -> bool:
    """Whether `program` (or one nested in it) has a primitive naming the axis."""
    jaxpr = _open(program)
    if id(jaxpr) not in self.mentions:
      self.keep.append(jaxpr)
      self.mentions[id(jaxpr)] = any(
          any(self.axis in _axes(eqn.params.get(p)) for p in _AXIS_PARAMS)
          or any(self.mention(p) for value in eqn.params.values() for p in _programs(value))
          for eqn in jaxpr.eqns)
    return self.mentions[id(jaxpr)]
