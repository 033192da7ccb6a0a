"""The order of MPI collectives in lowered (StableHLO) or compiled (HLO) text, and whether
consecutive ones are chained by data (what `python -m lab.bench gpu` and the tests check)."""

from __future__ import annotations

import re

# `%name = ...` or `%name:2 = ...` (StableHLO), `name = type op(...)` (HLO).
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)(?::\d+)?\s*=\s*(.*)$")
_USE = re.compile(r"%([\w.\-]+)")
# An MPI custom call that issues an exchange; an allreduce's ``_done`` half only waits for it.
_MPI = re.compile(r"custom_call(?:_target=\"|\s*@)(\w*mpi\w*?)(?<!_done)\b")


def mpi_calls(text: str) -> list[tuple[str, str]]:
  """``(value name, target)`` of every MPI custom call, in program order."""
  calls = []
  for line in text.splitlines():
    d, m = _DEF.match(line), _MPI.search(line)
    if d and m:
      calls.append((d.group(1), m.group(1)))
  return calls


def dependencies(text: str) -> dict[str, set[str]]:
  """Each defined value's direct operands (names without ``%`` and result index)."""
  deps = {}
  for line in text.splitlines():
    d = _DEF.match(line)
    if d:
      deps[d.group(1)] = {u.split("#")[0] for u in _USE.findall(d.group(2))}
  return deps


def depends_on(deps: dict[str, set[str]], value: str, target: str) -> bool:
  """Whether `value` (transitively) uses `target`."""
  seen, todo = set(), [value]
  while todo:
    v = todo.pop()
    for u in deps.get(v, ()):
      if u == target:
        return True
      if u not in seen:
        seen.add(u)
        todo.append(u)
  return False


def unchained(text: str) -> list[tuple[str, str]]:
  """Lowered StableHLO: consecutive MPI-issuing statements of one function where the later
  does not depend on the earlier's result (pairs a scheduler could swap). Empty: one order
  by data.

  A statement is a top-level op of a function body with its nested regions (a
  ``stablehlo.case`` whose branch holds the call, as the multi-device kinds lower), or a
  call of a function that issues MPI; region-local names are scoped to their statement.
  """
  funcs = _functions(text)
  issues = {name: any(_MPI.search(line) for line in lines) for name, lines in funcs.items()}
  pairs = []
  for lines in funcs.values():
    statements = _statements(lines)
    deps = {name: uses for name, uses, _ in statements}
    units = [name for name, _, body in statements
             if _MPI.search(body) or any(issues.get(f) for f in _CALLEE.findall(body))]
    pairs += [(a, b) for a, b in zip(units, units[1:]) if not depends_on(deps, b, a)]
  return pairs


_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.\-]+)")
_CALLEE = re.compile(r"call @([\w.\-]+)")


def _functions(text: str) -> dict[str, list[str]]:
  funcs, current, indent = {}, None, 0
  for line in text.splitlines():
    m = _FUNC.match(line)
    if m:
      current, indent = m.group(1), len(line) - len(line.lstrip())
      funcs[current] = []
    elif current is not None:
      if line.strip() == "}" and len(line) - len(line.lstrip()) == indent:
        current = None
      else:
        funcs[current].append(line)
  return funcs


def _statements(lines: list[str]) -> list[tuple[str, set[str], str]]:
  """``(defined name, names it uses from outside, text)`` of each top-level statement."""
  body = [line for line in lines if line.strip()]
  if not body:
    return []
  top = min(len(line) - len(line.lstrip()) for line in body)
  groups: list[list[str]] = []
  for line in body:
    starts = len(line) - len(line.lstrip()) == top and not line.lstrip().startswith("}")
    if starts or not groups:
      groups.append([line])
    else:
      groups[-1].append(line)
  out = []
  for group in groups:
    d = _DEF.match(group[0])
    inner = {m.group(1) for line in group[1:] if (m := _DEF.match(line))}
    uses = {u.split("#")[0] for line in group for u in _USE.findall(line)} - inner
    name = d.group(1) if d else f"<line {len(out)}>"
    out.append((name, uses - {name}, "\n".join(group)))
  return out


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """Compiled HLO's computations (name -> instruction lines) and the entry's name."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      comps[current] = []
      entry = current if header.group(1) else entry
    elif line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def entry_units(text: str) -> list[str]:
  """Compiled HLO: the entry computation's instructions that issue MPI calls, themselves or
  through the computations they call (a ``conditional`` whose branch holds the call, as the
  multi-device kinds compile), in schedule order."""
  comps, entry = _computations(text)
  holds: dict[str, bool] = {}

  def has_mpi(name: str, seen=()) -> bool:
    if name not in holds:
      lines = comps.get(name, [])
      holds[name] = any(_MPI.search(line) for line in lines) or any(
          has_mpi(ref, seen + (name,)) for line in lines for ref in _USE.findall(line)
          if ref in comps and ref not in seen and ref != name)
    return holds[name]

  units = []
  for line in comps.get(entry, []):
    d = _DEF.match(line)
    calls = any(ref in comps and has_mpi(ref) for ref in _USE.findall(line))
    if d and (_MPI.search(line) or calls):
      units.append(d.group(1))
  return units


def unchained_compiled(text: str) -> list[tuple[str, str]]:
  """`unchained` for compiled HLO, following MPI calls into called computations: the
  consecutive `entry_units` where the later does not depend on the earlier."""
  comps, entry = _computations(text)
  units, deps = entry_units(text), dependencies("\n".join(comps.get(entry, [])))
  return [(a, b) for a, b in zip(units, units[1:]) if not depends_on(deps, b, a)]
