"""`PerRankState`: a rank's own state, written by rank 0 as ``{"rank_0": ..., "rank_1": ...}``
in the node's place and restored to each rank bitwise (docs/design/checkpoints.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mnjax.checkpoint._rank_nodes import check_on_every_rank, find
from mnjax.checkpoint._template import is_key
from mnjax.comm._communicator import Communicator
from mnjax.comm._host import _objects as objects
from mnjax.comm._host import _transport as transport
from mnjax.optim._local_sgd import LocalSGDState
from mnjax.optim._shard_state import ShardedState

__all__ = ["PerRankState", "check", "expand", "gather", "own_inner_states", "pick",
           "whole_template", "without_own_inner_states"]


@jax.tree_util.register_pytree_with_keys_class
class PerRankState:
  """`inner`: rank `rank`'s own pytree (of `size`); `mnjax.Checkpointer` saves every rank's.

  Its one child is `inner`, keyed ``.rank_<rank>_of_<size>``; the nodes must sit at the same
  paths on every rank.

  Example:
    >>> import tempfile
    >>> stage = mnjax.checkpoint.PerRankState({"w": jnp.full(2, comm.rank)}, comm)
    >>> ckpt = mnjax.Checkpointer(tempfile.mkdtemp(), comm, async_save=False)
    >>> ckpt.save(1, {"stage": stage, "step": 1})
    >>> step, back, _ = ckpt.restore({"stage": stage, "step": 0})
    >>> back["stage"].inner["w"].tolist() == [comm.rank] * 2
    True
    >>> ckpt.close()
  """

  def __init__(self, inner: Any, comm: Communicator | None = None, *, rank: int | None = None,
               size: int | None = None):
    if comm is not None:
      rank, size = comm.rank, comm.size
    if rank is None or size is None:
      raise TypeError("PerRankState(inner, comm): pass the communicator (or rank= and size=).")
    self.inner, self.rank, self.size = inner, int(rank), int(size)

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey(f"rank_{self.rank}_of_{self.size}"), self.inner),), (
        self.rank, self.size)

  def tree_flatten(self):
    return (self.inner,), (self.rank, self.size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], rank=aux[0], size=aux[1])

  def __repr__(self) -> str:
    return f"PerRankState(rank={self.rank}, size={self.size}, inner={self.inner!r})"


def _is_own(x: Any) -> bool:
  return isinstance(x, PerRankState)


def _nodes(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
  """``[(path, leaf or PerRankState)]`` and the tree's structure above them."""
  return find(tree, PerRankState)


def _describe(inner: Any) -> tuple[Any, list[tuple[tuple[int, ...], str]]]:
  """The treedef and ``(shape, dtype)`` per leaf of `inner` (picklable, no data)."""
  leaves, treedef = jax.tree.flatten(inner)
  leaves = [jax.random.key_data(x) if is_key(x) else x for x in leaves]
  return treedef, [(tuple(np.shape(x)), str(np.dtype(x.dtype) if hasattr(x, "dtype")
                                          else np.asarray(x).dtype)) for x in leaves]


def check(comm: Communicator, tree: Any, caller: str) -> str | None:
  """What is wrong with the `PerRankState` s of `tree` (same on every rank) or None; collective."""

  def complaint(path: str, x: PerRankState) -> str | None:
    if (x.rank, x.size) != (comm.rank, comm.size):
      return (f"the PerRankState at {path} is rank {x.rank}'s of {x.size}, but the"
              f" communicator is rank {comm.rank} of {comm.size}: build it with"
              " PerRankState(inner, comm) for this communicator")
    if any(isinstance(y, ShardedState) for y in jax.tree.leaves(
        x.inner, is_leaf=lambda y: isinstance(y, ShardedState))):
      return (f"the PerRankState at {path} holds a shard_optimizer state; a ShardedState is"
              " already saved per rank: keep it outside the PerRankState")
    return None

  return check_on_every_rank(
      comm, tree, PerRankState, caller, "per-rank state", complaint=complaint,
      described=lambda nodes: [path for path, _ in nodes],
      problem=lambda problems: f"on rank {problems[0][0]}, {problems[0][1]}",
      mismatch=lambda first, rank, theirs: (
          f"the ranks hold PerRankState s at different paths: rank 0 {first}, rank {rank}"
          f" {theirs}. Every rank must pass a tree with a PerRankState at the same paths (its"
          " contents may differ)."))


def gather(comm: Communicator, tree: Any, to_host: Callable[[Any], Any]) -> list[list[Any]] | None:
  """Rank 0: ``[node][rank]`` host trees of every `PerRankState`'s `inner`; None elsewhere.
  Collective (call `check` first)."""
  inners = [jax.tree.map(to_host, x.inner) for _, x in _nodes(tree)[0] if _is_own(x)]
  if comm.size == 1:
    return [[inner] for inner in inners]
  mpi = comm.mpi_comm
  limit = transport.MAX_MESSAGE_BYTES
  described = mpi.gather((limit, [_describe(inner) for inner in inners]), root=0)
  if not comm.is_root:
    for inner in inners:
      for leaf in jax.tree.leaves(inner):
        payload = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
        for piece in transport.pieces(payload.size, limit):
          mpi.Send(payload[piece], dest=0, tag=7)
    return None
  out = []
  for node, inner in enumerate(inners):
    parts = [inner]
    for rank in range(1, comm.size):
      limit, nodes = described[rank]  # the sender's pieces
      treedef, signature = nodes[node]
      leaves = []
      for shape, dtype in signature:
        buffer = np.empty(shape, np.dtype(dtype))
        payload = buffer.reshape(-1).view(np.uint8)
        for piece in transport.pieces(payload.size, limit):
          mpi.Recv(payload[piece], source=rank, tag=7)
        leaves.append(buffer)
      parts.append(jax.tree.unflatten(treedef, leaves))
    out.append(parts)
  # Ranks send in node order, so rank 0 receives node by node from each rank in turn.
  return out


def expand(tree: Any, parts: list[list[Any]]) -> Any:
  """`tree` as written: each `PerRankState` replaced by ``{"rank_<r>": part}``."""
  flat, treedef = _nodes(tree)
  parts = iter(parts)
  return jax.tree.unflatten(treedef, [
      {f"rank_{r}": p for r, p in enumerate(next(parts))} if _is_own(x) else x for _, x in flat])


def whole_template(comm: Communicator, template: Any) -> Any:
  """`template` as on disk: each `PerRankState` replaced by every rank's placeholders."""
  flat, treedef = _nodes(template)
  mine = [_describe(x.inner) for _, x in flat if _is_own(x)]
  if not mine:
    return template
  everyone = objects.allgather_obj(mine, comm, operation="the per-rank states' template")
  out, node = [], 0
  for _, x in flat:
    if _is_own(x):
      out.append({f"rank_{r}": jax.tree.unflatten(every[node][0], [
          np.broadcast_to(np.zeros((), np.dtype(dtype)), shape) for shape, dtype in every[node][1]])
          for r, every in enumerate(everyone)})
      node += 1
    else:
      out.append(x)
  return jax.tree.unflatten(treedef, out)


def pick(comm: Communicator, state: Any, template: Any, like: Callable[[Any, Any], Any]) -> Any:
  """`state` (in `whole_template`'s form) with this rank's part put back in each node."""
  flat, treedef = _nodes(template)
  values = treedef.flatten_up_to(state)
  out = []
  for (_, t), value in zip(flat, values):
    if _is_own(t):
      value = PerRankState(jax.tree.map(like, value[f"rank_{comm.rank}"], t.inner),
                           rank=t.rank, size=t.size)
    out.append(value)
  return jax.tree.unflatten(treedef, out)


def _is_local(x: Any) -> bool:
  return isinstance(x, LocalSGDState)


def own_inner_states(comm: Communicator, tree: Any) -> Any:
  """`tree` with each `LocalSGDState`'s ``inner_state`` and ``inexact`` in `PerRankState` s.

  Example:
    >>> tx = mnjax.optim.local_sgd(optax.adam(0.1), comm, every_k=2)
    >>> own = own_inner_states(comm, tx.init({"w": jnp.ones(2)}))
    >>> type(own.inner_state).__name__
    'PerRankState'
  """
  def own(s):
    return s._replace(inner_state=PerRankState(s.inner_state, comm),
                      inexact=PerRankState(s.inexact, comm))
  return jax.tree.map(lambda s: own(s) if _is_local(s) else s, tree, is_leaf=_is_local)


def without_own_inner_states(tree: Any) -> Any:
  """The inverse of `own_inner_states`.

  Example:
    >>> tx = mnjax.optim.local_sgd(optax.adam(0.1), comm, every_k=2)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> back = without_own_inner_states(own_inner_states(comm, state))
    >>> jax.tree.structure(back) == jax.tree.structure(state)
    True
  """
  def whole(s):
    return s._replace(inner_state=s.inner_state.inner, inexact=s.inexact.inner)
  return jax.tree.map(
      lambda s: whole(s) if _is_local(s) and isinstance(s.inner_state, PerRankState) else s,
      tree, is_leaf=_is_local)
