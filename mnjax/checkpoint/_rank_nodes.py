"""The nodes of a saved tree that differ between ranks by design (`ShardedState`,
`PerRankState`): `find` them by type, `check_on_every_rank` before a save or restore."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mnjax.comm._communicator import Communicator
from mnjax.comm._host._agreement import gather_if_different

__all__ = ["check_on_every_rank", "find"]


def find(tree: Any, kind: type) -> tuple[list[tuple[str, Any]], Any]:
  """``[(path, leaf or node of type kind)]`` and the tree's structure above them.

  Example:
    >>> find({"a": (1, 2), "b": 3}, tuple)[0]
    [("['a']", (1, 2)), ("['b']", 3)]
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kind))
  return [(jax.tree_util.keystr(path), x) for path, x in flat], treedef


def check_on_every_rank(
    comm: Communicator, tree: Any, kind: type, caller: str, what: str, *,
    complaint: Callable[[str, Any], str | None],
    described: Callable[[list[tuple[str, Any]]], Any],
    problem: Callable[[list[tuple[int, str]]], str],
    mismatch: Callable[[Any, int, Any], str]) -> str | None:
  """What is wrong with the `kind` nodes of `tree` on some rank, the same text on every rank
  (None when nothing is). Collective (one small allgather; more only on a mismatch).

  ``complaint(path, node)``: what is wrong with this rank's node, or None; ``described(nodes)``:
  what every rank must agree on; ``problem([(rank, complaint)])`` and ``mismatch(rank 0's
  description, rank, its description)``: the messages. `caller` starts every message; `what`
  names the round (``"sharded state"``) if a rank never comes.

  Example:
    >>> check_on_every_rank(comm, {"a": (1, 2)}, tuple, "doc", "tuples",
    ...                     complaint=lambda path, x: None, described=len,
    ...                     problem=str, mismatch=str) is None
    True
  """
  nodes = [(path, x) for path, x in find(tree, kind)[0] if isinstance(x, kind)]
  mine = next((text for path, x in nodes if (text := complaint(path or "<root>", x))), None)
  everyone = (gather_if_different(comm, f"{caller}'s {what}", (described(nodes), mine),
                                  what=f"{caller}'s {what}")
              if comm.size > 1 else None)
  if everyone is None:
    return None if mine is None else f"{caller}: {mine}."
  problems = [(rank, text) for rank, (_, text) in enumerate(everyone) if text]
  if problems:
    return f"{caller}: {problem(problems)}."
  differing = next(rank for rank, (d, _) in enumerate(everyone) if d != everyone[0][0])
  return f"{caller}: {mismatch(everyone[0][0], differing, everyone[differing][0])}"
