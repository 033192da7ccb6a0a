"""What a compiled, scheduled GPU program does with its collectives: read from its HLO text.

After XLA's GPU passes (combiner, latency-hiding scheduler, buffer assignment) the entry
computation of ``compiled.as_text()`` lists its instructions in the order the GPU runs them.
An asynchronous collective is a ``*-start`` / ``*-done`` pair: what is scheduled between
the two runs beside the transfer (XLA marks a pair it found nothing to overlap with
``"is_sync":true`` and runs it synchronously). `schedule` returns, per collective: its
kind, payload bytes, the compute between start and done, and whether it is a gradient
exchange. mpi4jax's custom calls (the MPI kinds) are listed too; they block the compute
stream, so nothing ever runs beside them.

A collective is a **gradient exchange** when its result reaches the step's updated
parameters without passing through a convolution or matrix multiplication (BatchNorm
statistics feed the next layer's; the loss sum reaches no parameter). **Heavy compute** is
those convolutions and matrix multiplications (cuDNN, cuBLAS, Triton GEMM fusions); every
other kernel (elementwise fusions, reductions, copies) counts as compute too.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Collective", "Schedule", "schedule", "shape_bytes"]

_ASYNC = ("all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all")
_SYNC = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "collective-broadcast")
_MPI = re.compile(r"custom_call_target=\"(\w*mpi\w*)\"")
_TARGET = re.compile(r"custom_call_target=\"([^\"]+)\"")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                "partition-id", "replica-id", "opt-barrier", "copy-start", "copy-done",
                "send", "recv", "send-done", "recv-done", "add-dependency", "domain",
                "async-start", "async-update", "async-done"}
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (an array or a tuple of them).

  Example:
    >>> shape_bytes("(f32[512,2]{1,0}, bf16[8]{0}, token[])")
    4112
  """
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES.get(dtype, 4)
  return int(total)


@dataclasses.dataclass(frozen=True)
class _Instr:
  name: str
  shape: str
  op: str
  operands: tuple[str, ...]
  text: str


def _split_shape(rest: str) -> tuple[str, str]:
  """``"(f32[2], u8[]) op(...)..."`` -> (shape, the rest from the opcode)."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, tail = rest.partition(" ")
  return shape, tail


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
  """Computations (name -> instructions in order) and the entry's name."""
  comps: dict[str, list[_Instr]] = {}
  entry, current = None, None
  header = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
  line_re = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
  for line in text.splitlines():
    if current is None:
      m = header.match(line)
      if m and not line.lstrip().startswith("HloModule"):
        current = m.group(2)
        comps[current] = []
        entry = current if m.group(1) else entry
      continue
    if line.strip() == "}":
      current = None
      continue
    m = line_re.match(line)
    if not m:
      continue
    shape, tail = _split_shape(m.group(2))
    op = re.match(r"([\w\-]+)\(", tail)
    if op is None:
      continue
    args = tail[op.end():]
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        end = i
        break
    operands = tuple(re.findall(r"%([\w.\-]+)", args[:end]))
    comps[current].append(_Instr(m.group(1), shape, op.group(1), operands, line))
  return comps, entry


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the entry computation, in schedule order.

  Attributes:
    kind: ``all-reduce``, ``all-gather``, ``all-to-all``, ... or an MPI custom call target.
    payload_bytes: the bytes of its operands (for all-gather: one device's share).
    asynchronous: a start/done pair XLA kept asynchronous (MPI calls: never).
    compute_inside: kernels scheduled between start and done.
    heavy_inside: of those, convolutions and matrix multiplications.
    gradient_bytes: the bytes of its operands that are gradients (module docstring; a
      combined collective may carry gradients and BatchNorm statistics together).
    depends_on_heavy: whether a convolution or matrix multiplication of the step precedes
      it by data (False: it may start as soon as the step starts).
    position: index of its start among the entry's kernels (compute and collectives).
  """

  kind: str
  payload_bytes: int
  asynchronous: bool
  compute_inside: int
  heavy_inside: int
  gradient_bytes: int
  depends_on_heavy: bool
  position: int


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The collectives of a compiled step, and where its heavy compute is.

  Attributes:
    collectives: every collective, in schedule order.
    kernels: kernels of the entry computation (compute and collectives).
    last_heavy: position of the last convolution or matrix multiplication.
  """

  collectives: tuple[Collective, ...]
  kernels: int
  last_heavy: int

  @property
  def gradient_bytes(self) -> int:
    return sum(c.gradient_bytes for c in self.collectives)

  @property
  def gradients(self) -> tuple[Collective, ...]:
    return tuple(c for c in self.collectives if c.gradient_bytes)

  def overlap(self, mpi: bool = False) -> float:
    """Share of the gradient bytes whose exchange has compute scheduled beside it (0 when
    there is no gradient exchange). `mpi`: of the MPI calls only (the MPI kinds' exchange
    across processes; their XLA collectives are local)."""
    grads = [c for c in self.gradients if not mpi or "mpi" in c.kind]
    total = sum(c.gradient_bytes for c in grads)
    hidden = sum(c.gradient_bytes for c in grads if c.asynchronous and c.compute_inside)
    return hidden / total if total else 0.0

  def critical(self) -> tuple[Collective, ...]:
    """The collectives that are not gradient exchanges and have no compute beside them."""
    return tuple(c for c in self.collectives
                 if not c.gradient_bytes and not (c.asynchronous and c.compute_inside))

  def sequence(self) -> tuple[tuple[str, int], ...]:
    """``(kind, payload bytes)`` of every collective in order: what every process must issue
    alike."""
    return tuple((c.kind, c.payload_bytes) for c in self.collectives)


def _heavy(instr: _Instr) -> bool:
  if instr.op in ("convolution", "dot"):
    return True
  if instr.op == "custom-call":
    target = (_TARGET.search(instr.text) or [None, ""])[1]
    return any(k in target for k in ("cudnn", "cublas", "gemm", "conv"))
  return instr.op == "fusion" and ("__triton_gemm" in instr.text or "kCustom" in instr.text
                                   and "gemm" in instr.text)


def _holds_mpi(name: str, comps: dict[str, list[_Instr]], seen=()) -> str | None:
  """The MPI target called in computation `name` or in those it calls (a cond's branch)."""
  for i in comps.get(name, []):
    mpi = _MPI.search(i.text)
    if mpi:
      return mpi.group(1)
    for ref in re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=|"
                          r"calls=|to_apply=|, )%([\w.\-]+)", i.text):
      if ref in comps and ref not in seen and ref != name:
        found = _holds_mpi(ref, comps, (*seen, name))
        if found:
          return found
  return None


def _collective_kind(instr: _Instr, comps: dict[str, list[_Instr]]) -> str | None:
  mpi = _MPI.search(instr.text)
  if mpi:
    return mpi.group(1)
  if instr.op == "conditional":  # the multi-device MPI kinds: one device talks MPI
    for ref in re.findall(r"%([\w.\-]+)", instr.text.split(")", 1)[-1]):
      found = _holds_mpi(ref, comps) if ref in comps else None
      if found:
        return f"{found} (in a conditional)"
  if instr.op.endswith("-start") and instr.op[:-6] in _ASYNC:
    return instr.op[:-6]
  if instr.op == "async-start":
    called = _CALLS.search(instr.text)
    for inner in comps.get(called.group(1) if called else "", []):
      if inner.op in _SYNC:
        return inner.op
  if instr.op in _SYNC:
    return instr.op
  return None


def _output_deps(comp: list[_Instr]) -> list[set[int]] | None:
  """For a called computation whose ROOT is a tuple (a multi-output fusion): the parameter
  numbers each output depends on; None when the ROOT is not a tuple."""
  if not comp or comp[-1].op != "tuple":
    return None
  params = {i.name: int(m.group(1)) for i in comp if i.op == "parameter"
            and (m := re.search(r"parameter\((\d+)\)", i.text))}
  deps: dict[str, set[int]] = {}
  for i in comp:
    deps[i.name] = ({params[i.name]} if i.name in params else
                    set().union(*(deps.get(o, set()) for o in i.operands)))
  return [deps.get(o, set()) for o in comp[-1].operands]


def _value_users(instrs: list[_Instr], comps: dict[str, list[_Instr]]):
  """Edges between values ``(name, output index)`` (-1: an array result, -2: a whole tuple),
  through tuples, get-tuple-element and multi-output fusions element by element (other
  tuple results: every output from every operand)."""
  edges: dict[tuple[str, int], set[tuple[str, int]]] = {}
  arity = {i.name: len(_ARRAY.findall(i.shape)) for i in instrs if i.shape.startswith("(")}
  for i in instrs:
    if i.op == "get-tuple-element":
      k = int(re.search(r"index=(\d+)", i.text).group(1))
      for s in ((i.operands[0], k), (i.operands[0], -2)):
        edges.setdefault(s, set()).add((i.name, -1))
      continue
    outs = [(i.name, k) for k in range(arity[i.name])] if i.name in arity else [(i.name, -1)]
    called = _CALLS.search(i.text)
    per_output = _output_deps(comps.get(called.group(1), [])) if (
        called and i.op == "fusion" and i.name in arity) else None
    for j, o in enumerate(i.operands):
      if i.op == "tuple":
        targets = [(i.name, j)]
      elif per_output is not None:
        targets = [(i.name, k) for k, d in enumerate(per_output) if j in d]
      else:
        targets = outs
      sources = ([(o, -2)] + [(o, k) for k in range(arity[o])]) if o in arity else [(o, -1)]
      for s in sources:  # an element of a tuple operand reaches what the tuple reaches
        edges.setdefault(s, set()).update(targets)
  return edges


def _reach(edges, start: tuple[str, int]) -> set[str]:
  seen, todo = {start}, [start]
  while todo:
    for u in edges.get(todo.pop(), ()):
      if u not in seen:
        seen.add(u)
        todo.append(u)
  return {name for name, _ in seen}


def _parts(value: tuple[str, int], nbytes: int, direct: dict, by_name: dict) -> list:
  """`value` with its bytes, or, where XLA combined collectives by concatenating their
  buffers, the slices its users cut from it (each a former collective of its own)."""
  name, k = value
  users = direct.get(name, [])
  if k == -1 and users and all(u.op == "slice" or u.op == "fusion" and "slice" in u.name
                               for u in users):
    return [((u.name, -1), shape_bytes(u.shape)) for u in users]
  return [(value, nbytes)]


def schedule(text: str, parameter_outputs: set[int] | None = None) -> Schedule:
  """The collectives of compiled HLO `text` (``compiled.as_text()``), in schedule order.

  Args:
    text: the compiled module's text.
    parameter_outputs: positions in the entry's ROOT tuple of the updated parameters; a
      collective is a gradient exchange only if it reaches one of them (None: any output).

  Example:
    >>> text = '''ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   %s = f32[4]{0} all-reduce-start(%p), to_apply=%add
    ...   %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%g
    ...   %d = f32[4]{0} all-reduce-done(%s)
    ...   ROOT %r = f32[4]{0} fusion(%d, %f), kind=kLoop, calls=%h
    ... }'''
    >>> s = schedule(text)
    >>> s.collectives[0].compute_inside, s.overlap()
    (1, 1.0)
  """
  comps, entry = _parse(text)
  instrs = comps.get(entry, [])
  by_name = {i.name: i for i in instrs}
  edges = _value_users(instrs, comps)
  direct: dict[str, list[_Instr]] = {}
  for i in instrs:
    for o in set(i.operands):
      direct.setdefault(o, []).append(i)
  root = instrs[-1] if instrs else None
  outputs = set(root.operands) if root is not None and root.op == "tuple" else (
      {root.name} if root is not None else set())
  if parameter_outputs is not None and root is not None and root.op == "tuple":
    outputs = {root.operands[k] for k in parameter_outputs if k < len(root.operands)}
  heavy = {i.name for i in instrs if _heavy(i)}
  ancestors_heavy: dict[str, bool] = {}
  for i in instrs:  # in schedule order: operands come first
    ancestors_heavy[i.name] = any(o in heavy or ancestors_heavy.get(o, False)
                                  for o in i.operands)
  done_of = {}
  for i in instrs:
    if i.op.endswith("-done") and i.operands:
      done_of[i.operands[0]] = i.name
  kernels, position = [], {}
  for i in instrs:
    if i.op not in _NOT_COMPUTE or i.op == "async-start" or _collective_kind(i, comps):
      if not i.op.endswith("-done"):
        position[i.name] = len(kernels)
        kernels.append(i)
  collectives, last_heavy = [], max((position[n] for n in heavy if n in position), default=-1)
  order = {i.name: k for k, i in enumerate(instrs)}
  collective = {k.name: _collective_kind(k, comps) for k in kernels}
  for i in instrs:
    kind = _collective_kind(i, comps)
    if kind is None or i.op.endswith("-done"):
      continue
    done = done_of.get(i.name)
    start_at = position[i.name]
    inside = []
    if done is not None:
      inside = [k for k in kernels[start_at + 1:]
                if order[k.name] < order[done] and not collective.get(k.name)]
    result = done or i.name
    payloads = [shape_bytes(by_name[o].shape) for o in i.operands if o in by_name
                and not by_name[o].shape.startswith("token")]
    if i.op == "conditional":  # (branch index, buffer, order operand) -> the buffer
      payloads = [max(payloads[1:], default=0)]
    gradient_bytes = 0
    for k, nbytes in enumerate(payloads):  # a combined collective: each operand by itself
      start = (result, k) if by_name[result].shape.startswith("(") else (result, -1)
      for value, part in _parts(start, nbytes, direct, by_name):
        reached = _reach(edges, value)
        if reached & outputs and not reached & heavy:
          gradient_bytes += part
    asynchronous = done is not None and '"is_sync":true' not in i.text
    collectives.append(Collective(
        kind=kind, payload_bytes=sum(payloads), asynchronous=asynchronous,
        compute_inside=len(inside) if asynchronous else 0,
        heavy_inside=sum(k.name in heavy for k in inside) if asynchronous else 0,
        gradient_bytes=gradient_bytes,
        depends_on_heavy=ancestors_heavy.get(i.name, False), position=start_at))
  return Schedule(tuple(collectives), len(kernels), last_heavy)
