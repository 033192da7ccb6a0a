"""`shard_optimizer` state in checkpoints: each `ShardedState` is written whole (`gather`) and
cut to the restoring rank's share (`reshard`), so a run saved on P ranks resumes on Q."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mnjax.checkpoint._rank_nodes import check_on_every_rank, find
from mnjax.comm._communicator import Communicator
from mnjax.comm._host._signature import tree_signature
from mnjax.optim._shard_state import ShardedState, cut_like, gather_to_root, whole_like

__all__ = ["check", "gather", "host_tree", "reshard", "whole_template"]


def _is_sharded(x: Any) -> bool:
  return isinstance(x, ShardedState)


def _split(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
  """``[(path, leaf or ShardedState)]`` and the tree's structure above them."""
  return find(tree, ShardedState)


def check(comm: Communicator, tree: Any, caller: str) -> str | None:
  """What is wrong with the `ShardedState` s of `tree` (same on every rank) or None; collective."""

  def complaint(path: str, x: ShardedState) -> str | None:
    if (x.index, x.parts) != (comm.rank, comm.size):
      return (f"at {path} rank {comm.rank} holds share {x.index} of {x.parts}, but the"
              f" communicator is rank {comm.rank} of {comm.size}")
    if x.layout is None:
      return (f"the ShardedState at {path} has no layout (it was not made by"
              " shard_optimizer's init or scatter_optimizer_state)")
    return None

  return check_on_every_rank(
      comm, tree, ShardedState, caller, "sharded state", complaint=complaint,
      described=lambda nodes: [(path, x.parts, x.layout, tree_signature(x.inner))
                               for path, x in nodes],
      problem=lambda problems: f"{problems[0][1]} (and on {len(problems) - 1} more ranks)",
      mismatch=lambda first, rank, theirs: (
          f"the ranks hold different shard_optimizer states: rank 0 {[p for p, *_ in first]},"
          f" rank {rank} {[p for p, *_ in theirs]} (paths of the ShardedState s; or their"
          " leaves differ). Every rank must pass the same tree."))


def gather(comm: Communicator, tree: Any) -> list[Any] | None:
  """Rank 0: the whole inner state of each `ShardedState` of `tree`; None elsewhere."""
  wholes = [gather_to_root(comm, x) for _, x in _split(tree)[0] if _is_sharded(x)]
  return wholes if comm.is_root else None


def host_tree(tree: Any, wholes: list[Any], to_host: Callable[[Any], Any]) -> Any:
  """The tree as written: `ShardedState` s replaced by `wholes`, other leaves `to_host`."""
  flat, treedef = _split(tree)
  wholes = iter(wholes)
  return jax.tree.unflatten(treedef, [next(wholes) if _is_sharded(x) else to_host(x)
                                      for _, x in flat])


def whole_template(template: Any) -> Any:
  """`template` as on disk: each `ShardedState` replaced by its whole state's placeholders."""
  flat, treedef = _split(template)
  return jax.tree.unflatten(treedef, [whole_like(x) if _is_sharded(x) else x for _, x in flat])


def reshard(state: Any, template: Any, like: Callable[[Any, Any], Any]) -> Any:
  """`state` (in `whole_template`'s form) with each whole state cut to the template's share."""
  flat, treedef = _split(template)
  parts = treedef.flatten_up_to(state)
  out = []
  for (_, t), value in zip(flat, parts):
    if _is_sharded(t):
      cut = cut_like(t, value)
      value = ShardedState(jax.tree.map(like, cut.inner, t.inner), t.index, t.parts, t.layout)
    out.append(value)
  return jax.tree.unflatten(treedef, out)
