"""Reading the order of MPI collectives out of lowered (StableHLO) or compiled (HLO) text."""

from __future__ import annotations

import re

# `%name = ...` or `%name:2 = ...` (StableHLO), `name = type op(...)` (HLO).
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)(?::\d+)?\s*=\s*(.*)$")
_USE = re.compile(r"%([\w.\-]+)")
_MPI = re.compile(r"custom_call(?:_target=\"|\s*@)(\w*mpi\w*)")


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
  """Consecutive MPI calls ``(earlier, later)`` where the later does not depend on the
  earlier's result: pairs that a scheduler could swap. Empty: one order by data."""
  calls, deps = mpi_calls(text), dependencies(text)
  return [(a, b) for (a, _), (b, _) in zip(calls, calls[1:]) if not depends_on(deps, b, a)]
