"""`shard_optimizer`'s state, and its rank-count-independent form for checkpoints."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import check_communicator
from mnjax.comm._host._agreement import check_same_tree
from mnjax.comm._instep import _scatter as scatter
from mnjax.guard import _preflight as preflight

__all__ = ["ShardedState", "check_state", "cut_like", "cut_shares", "gather_optimizer_state",
           "gather_to_root", "join_shares", "scatter_optimizer_state", "sharded_state",
           "whole_like"]


@jax.tree_util.register_pytree_with_keys_class
class ShardedState:
  """`shard_optimizer`'s state: `inner` on this rank's shares, share `index` of `parts`.

  Its one child `inner` is under the key ``.shard_<index>_of_<parts>`` (the ranks' trees
  differ). `layout` (static): per leaf of `inner`, the whole shape, or None if not sharded.

  Example:
    >>> state = mnjax.shard_optimizer(optax.adam(1e-3), comm).init({"w": jnp.ones(3)})
    >>> state.parts == comm.size, jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(
    ...     state)[0][0][0]).startswith(f".shard_{comm.rank}_of_{comm.size}")
    (True, True)
    >>> state.layout   # the step count, then mu and nu of the leaf of shape (3,)
    (None, (3,), (3,))
  """

  def __init__(self, inner: Any, index: int, parts: int,
               layout: tuple[tuple[int, ...] | None, ...] | None = None):
    self.inner, self.index, self.parts = inner, int(index), int(parts)
    self.layout = None if layout is None else tuple(
        None if shape is None else tuple(int(d) for d in shape) for shape in layout)

  def tree_flatten_with_keys(self):
    key = jax.tree_util.GetAttrKey(f"shard_{self.index}_of_{self.parts}")
    return ((key, self.inner),), (self.index, self.parts, self.layout)

  def tree_flatten(self):
    return (self.inner,), (self.index, self.parts, self.layout)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self) -> str:
    return f"ShardedState(index={self.index}, parts={self.parts}, inner={self.inner!r})"


def sharded_state(tx: Any, params: Any, inner: Any, index: int, parts: int, *,
                  caller: str = "shard_optimizer") -> ShardedState:
  """`ShardedState` of `inner` (``tx.init`` of this rank's shares) with its `layout`.

  Example:
    >>> tx, params = optax.sgd(0.1, momentum=0.9), {"w": jnp.ones((2, 3))}
    >>> inner = tx.init({"w": jnp.ones(-(-6 // comm.size))})
    >>> sharded_state(tx, params, inner, comm.rank, comm.size).layout
    ((2, 3),)
  """
  return ShardedState(inner, index, parts, _layout(tx, params, parts, caller, inner))


def check_state(state: Any, index: int, parts: int, caller: str) -> None:
  """The state is `ShardedState` for this rank's share, with share-sized leaves."""
  if not isinstance(state, ShardedState):
    raise TypeError(
        f"{caller}: the optimizer state must be the ShardedState this transformation's init"
        f" returned, got {type(state).__name__}. A state gathered for a checkpoint"
        " (gather_optimizer_state) goes back through scatter_optimizer_state first.")
  if (state.index, state.parts) != (index, parts):
    raise ValueError(
        f"{caller}: this optimizer state holds share {state.index} of {state.parts}, but this"
        f" is rank {index} of {parts}. Restore the full state (gather_optimizer_state, saved"
        " with the checkpoint) and cut it for this job with scatter_optimizer_state.")


def gather_optimizer_state(comm, tx: Any, state: ShardedState, params: Any) -> Any:
  """The whole state of `tx` from every rank's shares (numpy leaves), on every rank.

  Collective, host-level; each rank briefly holds it all. `tx`: the one `shard_optimizer` wraps.

  Example:
    >>> tx = optax.adam(1e-3)
    >>> params = {"w": jnp.ones((3, 2))}
    >>> state = mnjax.shard_optimizer(tx, comm).init(params)
    >>> full = mnjax.optim.gather_optimizer_state(comm, tx, state, params)
    >>> full[0].mu["w"].shape
    (3, 2)
    >>> state = mnjax.optim.scatter_optimizer_state(comm, tx, full, params)
  """
  caller = "gather_optimizer_state"
  check_communicator(comm, caller)
  check_state(state, comm.rank, comm.size, caller)
  check_same_tree(state.inner, comm, caller)
  leaves, treedef = jax.tree.flatten(state.inner)
  host = [np.asarray(x) for x in leaves]
  if comm.size == 1:
    every = [host]
  else:  # one allgather of every rank's shares, as raw bytes
    mine = np.concatenate([np.ascontiguousarray(x).view(np.uint8).ravel() for x in host])
    buf = np.empty((comm.size, mine.size), np.uint8)
    comm.mpi_comm.Allgather(mine, buf)
    every = []
    for r in range(comm.size):
      row = np.ascontiguousarray(buf[r])
      every.append([x.view(h.dtype).reshape(h.shape) for x, h in zip(
          np.split(row, np.cumsum([h.nbytes for h in host])[:-1]), host)])
  return join_shares(tx, [jax.tree.unflatten(treedef, x) for x in every], params,
                     caller=caller)


def join_shares(tx: Any, inners: list[Any], params: Any, *,
                caller: str = "join_shares") -> Any:
  """The whole state of `tx` from all shares' inner states, in share order (local).

  Example:
    >>> tx, params = optax.adam(1e-3), {"w": jnp.arange(5.0)}
    >>> full = tx.init(params)
    >>> inners = [cut_shares(tx, full, params, i, 3) for i in range(3)]
    >>> join_shares(tx, inners, params)[0].mu["w"].shape
    (5,)
  """
  layout = _layout(tx, params, len(inners), caller, inners[0])
  return _join(layout, inners)


def _join(layout: tuple, inners: list[Any]) -> Any:
  """The whole inner state from every share's, leaf by leaf as `layout` says."""
  flat = [jax.tree.flatten(inner)[0] for inner in inners]
  out = [np.asarray(flat[0][i]) if shape is None else
         scatter.unshard_leaf(np.stack([np.asarray(f[i]) for f in flat]), shape)
         for i, shape in enumerate(layout)]
  return jax.tree.unflatten(jax.tree.structure(inners[0]), out)


def gather_to_root(comm, state: ShardedState, *, root: int = 0) -> Any:
  """The whole inner state (numpy leaves) on rank `root`, None on the others (collective).

  Example:
    >>> state = mnjax.shard_optimizer(optax.adam(1e-3), comm).init({"w": jnp.ones((3, 2))})
    >>> gather_to_root(comm, state)[0].mu["w"].shape if comm.is_root else None
    (3, 2)
  """
  leaves, treedef = jax.tree.flatten(state.inner)
  host = [np.asarray(x) for x in leaves]
  every = [list(host) for _ in range(comm.size)] if comm.is_root else None
  for i, (x, shape) in enumerate(zip(host, state.layout)):
    if shape is None or comm.size == 1:  # the same on every rank: rank root's own
      continue
    mine = np.ascontiguousarray(x).view(np.uint8).ravel()
    buf = np.empty((comm.size, mine.size), np.uint8) if comm.is_root else None
    comm.mpi_comm.Gather(mine, buf, root=root)
    if comm.is_root:
      for r in range(comm.size):
        every[r][i] = buf[r].view(x.dtype).reshape(x.shape)
  if not comm.is_root:
    return None
  return _join(state.layout, [jax.tree.unflatten(treedef, x) for x in every])


def whole_like(state: ShardedState) -> Any:
  """Read-only placeholders (allocating nothing) of the whole inner state of `state`.

  Example:
    >>> state = mnjax.shard_optimizer(optax.adam(1e-3), comm).init({"w": jnp.ones((3, 2))})
    >>> whole_like(state)[0].mu["w"].shape
    (3, 2)
  """
  leaves, treedef = jax.tree.flatten(state.inner)
  return jax.tree.unflatten(treedef, [
      np.broadcast_to(np.zeros((), x.dtype), np.shape(x) if shape is None else shape)
      for x, shape in zip(leaves, state.layout)])


def cut_like(state: ShardedState, whole: Any) -> ShardedState:
  """`state`'s share of `whole` (like `whole_like(state)`), as a `ShardedState` (local).

  Example:
    >>> tx, params = optax.adam(1e-3), {"w": jnp.arange(5.0)}
    >>> state = mnjax.shard_optimizer(tx, comm).init(params)
    >>> cut_like(state, tx.init(params)).inner[0].mu["w"].shape == state.inner[0].mu["w"].shape
    True
  """
  leaves = jax.tree.structure(state.inner).flatten_up_to(whole)
  out = [np.asarray(x) if shape is None else _share(np.asarray(x), state.index, state.parts)
         for x, shape in zip(leaves, state.layout)]
  return ShardedState(jax.tree.unflatten(jax.tree.structure(state.inner), out), state.index,
                      state.parts, state.layout)


def _share(x: np.ndarray, index: int, parts: int) -> np.ndarray:
  """`mnjax.comm._instep._scatter.shard_leaf` on the host: share `index` of `parts`, zero-padded."""
  flat = x.reshape(-1)
  c = scatter.share_size(flat.size, parts)
  out = np.zeros(c, x.dtype)
  piece = flat[index * c:(index + 1) * c]
  out[:piece.size] = piece
  return out


def scatter_optimizer_state(comm, tx: Any, full_state: Any, params: Any) -> ShardedState:
  """This rank's `ShardedState` cut from a whole state of `tx` (local, no communication).

  Example:
    >>> tx = optax.adam(1e-3)
    >>> params = {"w": jnp.ones((3, 2))}
    >>> state = mnjax.optim.scatter_optimizer_state(comm, tx, tx.init(params), params)
    >>> state.parts == comm.size
    True
  """
  caller = "scatter_optimizer_state"
  check_communicator(comm, caller)
  inner = cut_shares(tx, full_state, params, comm.rank, comm.size, caller=caller)
  return sharded_state(tx, params, inner, comm.rank, comm.size, caller=caller)


def cut_shares(tx: Any, full_state: Any, params: Any, index: int, parts: int, *,
               caller: str = "cut_shares") -> Any:
  """Share `index` of `parts` of a whole state of `tx` (local).

  Example:
    >>> tx, params = optax.adam(1e-3), {"w": jnp.arange(5.0)}
    >>> cut_shares(tx, tx.init(params), params, 1, 2)[0].mu["w"].shape
    (3,)
  """
  expected = jax.eval_shape(tx.init, params)
  leaves, treedef = jax.tree.flatten(full_state)
  want, want_def = jax.tree.flatten(expected)
  if treedef != want_def or any(np.shape(x) != tuple(w.shape) for x, w in zip(leaves, want)):
    raise ValueError(
        f"{caller}: full_state is not a whole state of tx for these parameters: got"
        f" {preflight.tree_signature(full_state)[:4]}..., expected"
        f" {preflight.tree_signature(expected)[:4]}... Pass what gather_optimizer_state"
        " returned (e.g. restored from the checkpoint), with the same tx and parameters.")
  inner = jax.eval_shape(lambda p: tx.init(jax.tree.map(
      lambda x: scatter.shard_leaf(x, index, parts), p)), params)
  layout = _layout(tx, params, parts, caller, inner)
  out = [jnp.asarray(x) if full is None else scatter.shard_leaf(jnp.asarray(x), index, parts)
         for x, full in zip(leaves, layout)]
  return jax.tree.unflatten(treedef, out)


def _layout(tx: Any, params: Any, parts: int, caller: str, inner: Any) -> list[Any]:
  """Per state leaf: the whole shape if it is a share, else None."""
  leaves, treedef = jax.tree.flatten(params)

  def abstract(extra: int) -> Any:
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct((scatter.share_size(np.size(x), parts) + extra,),
                             jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)
        for x in leaves])

  whole = jax.tree.flatten(jax.eval_shape(tx.init, params))
  mine = jax.tree.flatten(inner)
  longer = jax.tree.flatten(jax.eval_shape(tx.init, abstract(1)))
  if not whole[1] == mine[1] == longer[1]:
    raise ValueError(
        f"{caller}: tx's state has another structure on shares than on the whole"
        f" parameters ({mine[1]} vs {whole[1]}); it is not a state shard_optimizer can join."
        " Pass the same tx as to shard_optimizer.")
  out = []
  for w, m, y in zip(whole[0], mine[0], longer[0]):
    shape, share = tuple(w.shape), tuple(np.shape(m))
    if tuple(y.shape) == share:
      out.append(None)
    elif share == (scatter.share_size(int(np.prod(shape, dtype=np.int64)), parts),):
      out.append(shape)
    else:
      raise ValueError(f"{caller}: a state leaf of shape {share} is neither the share of a"
                       f" leaf of shape {shape} over {parts} ranks nor the same on every rank.")
  return out
