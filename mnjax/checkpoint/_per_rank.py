"""State a save by rank 0 would lose, refused on every rank: a half-done accumulation cycle
(`mid_cycle`), leaves or ``meta`` that differ between replicas (`differences`)."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from mnjax.checkpoint._own_state import PerRankState
from mnjax.checkpoint._template import is_key
from mnjax.comm._communicator import Communicator
from mnjax.comm._host import _objects as objects
from mnjax.comm._host._digest import compare_digests
from mnjax.comm._host._signature import leaf_paths
from mnjax.guard._consensus import fingerprints
from mnjax.optim._accumulation import AccumulationState
from mnjax.optim._double_buffering import PendingGradient
from mnjax.optim._local_sgd import LocalSGDState
from mnjax.optim._shard_state import ShardedState

__all__ = ["differences", "mid_cycle"]

_LISTED = 10


def mid_cycle(comm: Communicator, state: Any) -> str:
  """Why `state` cannot be saved: an `accumulate_gradients` cycle half done; else ''.

  Example:
    >>> tx = mnjax.accumulate_gradients(optax.sgd(0.1), every_k=2)
    >>> mid_cycle(comm, tx.init({"w": jnp.ones(2)}))      # no micro-step taken yet
    ''
  """
  if comm.num_replicas == 1:
    return ""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, AccumulationState))
           if isinstance(s, AccumulationState)]
  steps = [int(np.asarray(s.micro_step).reshape(-1)[0]) for s in found]
  if not any(steps):
    return ""
  return (f"Checkpointer.save: the optimizer state is inside an accumulate_gradients cycle"
          f" (micro-step {max(steps)}): its gradient sum so far is each replica's own and"
          " rank 0 writes only its own, so a resumed run would lose the other replicas'"
          " micro-batches. Save after a whole cycle (when the step count is a multiple of"
          " every_k).")


def _comparable(state: Any) -> Any:
  """`state` without its `ShardedState` s and `PerRankState` s, keys as key data."""
  def prepare(x):
    if isinstance(x, (ShardedState, PerRankState)):
      return None
    return jax.random.key_data(x) if is_key(x) else x
  return jax.tree.map(prepare, state,
                      is_leaf=lambda x: isinstance(x, (ShardedState, PerRankState)))


def _fix(paths: list[str], state: Any) -> str:
  """What to do about the differing leaves `paths` of `state`, for the kinds recognised."""
  nodes = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, (PendingGradient, ShardedState)))[0]
  pending = [jax.tree_util.keystr(p) + ".pending" for p, x in nodes
             if isinstance(x, PendingGradient)]
  keys = {path for path, leaf in zip(leaf_paths(state), jax.tree.leaves(state)) if is_key(leaf)}
  fixes = []
  if any(p.startswith(tuple(pending)) for p in paths):
    fixes.append(
        "the double-buffered pending gradient (create_multi_node_optimizer(tx, comm,"
        " double_buffering=True)) is each replica's own until it is flushed, and it was not"
        " flushed: call"
        " opt_state = mnjax.train.flush_pending(opt_state, comm) on every rank before saving,"
        " and train on with that state (lab.runner.train_loop does both)")
  if any(isinstance(x, LocalSGDState) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, LocalSGDState))):
    fixes.append(
        "local_sgd's replicas differ between meetings: save right after a meeting (call"
        " opt_state = mnjax.optim.meet_next_step(opt_state) on every rank before the step"
        " that precedes the save) with params = opt_state.anchor, the meeting's bits")
  if any("['batch_stats']" in p for p in paths):
    fixes.append(
        "BatchNorm statistics of per-replica flax nn.BatchNorm differ between replicas: use"
        " mnjax.SyncBatchNorm (global-batch statistics), or average them with"
        " mnjax.nn.allreduce_persistent(batch_stats, comm) on every rank before saving")
  if keys.intersection(paths):
    fixes.append(
        "a random key differs between ranks: keep one key in the state (the same on every"
        " rank) and derive each rank's own inside the step with jax.random.fold_in(key,"
        " comm.rank)")
  fixes.append(
      "every leaf must be the same on every replica when it is saved (parameters and"
      " optimizer state are, after allreduce_gradients); leave per-rank values out of the"
      " saved tree, or wrap a rank's own state (a model-parallel stage's parameters and"
      " optimizer state) in mnjax.checkpoint.PerRankState(tree, comm) to save every rank's")
  return "; ".join(fixes)


def differences(comm: Communicator, state: Any, meta: Any) -> str:
  """Why saving from rank 0 would lose another replica's values ('' if none), the same on
  every rank. Collective (one allgather of fingerprints).

  Example:
    >>> differences(comm, {"w": jnp.ones(3)}, {"epoch": 1})
    ''
  """
  mine = fingerprints(_comparable(state))
  meta_text = json.dumps(meta, sort_keys=True, default=repr)
  everyone = objects.allgather_obj((mine, meta_text, repr(meta)), comm,
                                   operation="Checkpointer.save's check of every replica")
  reference = everyone[0][0]
  differing: dict[str, list[str]] = {}
  for rank, (theirs, _, _) in enumerate(everyone):
    for path, how in compare_digests(reference, theirs).items():
      differing.setdefault(path, []).append(f"rank {rank} {how}".rstrip())
  if differing:
    paths = list(differing)
    listed = "; ".join(f"{path}: {', '.join(ranks)} differ from rank 0"
                       for path, ranks in list(differing.items())[:_LISTED])
    more = f" (and {len(paths) - _LISTED} more)" if len(paths) > _LISTED else ""
    return (f"Checkpointer.save: {len(paths)} of {len(reference)} leaves differ between"
            f" replicas, and rank 0 writes only its own copy (a restore gives every rank"
            f" rank 0's, and the others' values are lost): {listed}{more}. Fix: "
            f"{_fix(paths, state)}.")
  metas = [(rank, shown) for rank, (_, text, shown) in enumerate(everyone)
           if text != everyone[0][1]]
  if metas:
    rank, shown = metas[0]
    return (f"Checkpointer.save: the meta differs between ranks (rank 0 {everyone[0][2]},"
            f" rank {rank} {shown}), and rank 0 writes only its own: a resumed run would"
            " take rank 0's on every rank. Pass the same meta on every rank.")
  return ""
