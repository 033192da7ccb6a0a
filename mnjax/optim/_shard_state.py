"""`shard_optimizer`'s state, and its rank-count-independent form for checkpoints.

`ShardedState` holds the inner transformation's state on this rank's shares. For a
checkpoint, `gather_optimizer_state` joins every rank's shares into the whole state
``tx.init(params)`` would hold unsharded (the same on every rank, independent of the number
of ranks); `scatter_optimizer_state` cuts such a state for the ranks of a job, of any size.
`join_shares` and `cut_shares` are their local cores (no communication).

`mnjax.Checkpointer` does this by itself for a tree holding a `ShardedState`: the state
records its `layout` (the whole shape of each share leaf), so `gather_to_root` joins it on
rank 0 for the write and `cut_like` cuts the restored whole state for the restoring rank,
with neither tx nor the parameters at hand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm import _scatter as scatter
from mnjax.comm._communicator import check_communicator
from mnjax.comm._host import check_same_tree
from mnjax.guard import _preflight as preflight

__all__ = ["ShardedState", "check_state", "cut_like", "cut_shares", "gather_optimizer_state",
           "gather_to_root", "join_shares", "scatter_optimizer_state", "sharded_state",
           "whole_like"]


@jax.tree_util.register_pytree_with_keys_class
class ShardedState:
  """`shard_optimizer`'s state: `inner`, the inner transformation's state on this rank's
  shares, for share `index` of `parts`.

  A pytree whose one child is `inner`, under the key ``.shard_<index>_of_<parts>``: leaf
  paths say which share a rank holds, so replicated-state tools (`mnjax.check_replicas`)
  see that ranks hold different trees rather than mixing them. `layout` (static, part of
  the tree structure) gives, per leaf of `inner`, the whole leaf's shape when the leaf is a
  share, or None for a leaf the same on every rank (a step count): with it the state can be
  joined (`gather_to_root`) and cut again (`cut_like`) without the transformation, which is
  how `mnjax.Checkpointer` saves it whole and restores it on any number of ranks.

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
  """`ShardedState` of `inner` (``tx.init`` of this rank's shares of `params`) with its
  `layout` (traced abstractly, no computation).

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
  """The whole state of `tx` from every rank's shares: what ``tx.init(params)`` holds after
  the same steps unsharded (numpy leaves), the same on every rank. Collective, host-level.

  Save this in a checkpoint (it does not depend on the number of ranks) and cut it again
  with `scatter_optimizer_state`. Each rank briefly holds the whole state.

  Args:
    comm: the `Communicator` the state was sharded over.
    tx: the inner transformation passed to `shard_optimizer`.
    state: the `ShardedState` of this rank.
    params: the parameters (their shapes say how to join the shares).

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
  """The whole state of `tx` from the inner states of all shares, in share order (local:
  the core of `gather_optimizer_state`). A leaf that is not a share (a step count) is taken
  from share 0.

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
  """The whole inner state from every share's (numpy leaves), leaf by leaf as `layout`
  says: a share leaf unsharded, any other leaf taken from share 0."""
  flat = [jax.tree.flatten(inner)[0] for inner in inners]
  out = [np.asarray(flat[0][i]) if shape is None else
         scatter.unshard_leaf(np.stack([np.asarray(f[i]) for f in flat]), shape)
         for i, shape in enumerate(layout)]
  return jax.tree.unflatten(jax.tree.structure(inners[0]), out)


def gather_to_root(comm, state: ShardedState, *, root: int = 0) -> Any:
  """The whole inner state (numpy leaves, as `gather_optimizer_state` returns it) on rank
  `root`, None on the others: one MPI gather per share leaf, so only `root` ever holds the
  whole state. Collective, host-level; no tx or parameters needed (``state.layout``).

  The caller has checked that every rank passes its own share (``index == comm.rank``,
  ``parts == comm.size``), with a layout and the same leaves (`mnjax.Checkpointer` does).

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
  """Placeholders of the whole inner state (numpy, read-only and allocating nothing): each
  share leaf at its whole shape, every other leaf as it is; the dtypes of `state`'s.

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
  """`state`'s share of `whole` (a whole inner state like `whole_like(state)`): a
  `ShardedState` of the same share and layout, numpy leaves (local, no communication; the
  cut `scatter_optimizer_state` makes).

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
  """`mnjax.comm._scatter.shard_leaf` on the host: share `index` of `parts`, zero-padded."""
  flat = x.reshape(-1)
  c = scatter.share_size(flat.size, parts)
  out = np.zeros(c, x.dtype)
  piece = flat[index * c:(index + 1) * c]
  out[:piece.size] = piece
  return out


def scatter_optimizer_state(comm, tx: Any, full_state: Any, params: Any) -> ShardedState:
  """This rank's `ShardedState` cut from a whole state of `tx` (`gather_optimizer_state`'s,
  restored from a checkpoint saved on any number of ranks). Local: no communication.

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
  """Share `index` of `parts` of a whole state of `tx` (the inner state of that share;
  local: the core of `scatter_optimizer_state`).

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
  """Per leaf of the sharded state: the whole leaf's shape if it is a share, else None
  (a leaf the same on every rank, like a step count). A share is a leaf whose shape follows
  the shares' size: ``tx.init`` is traced on shares one element longer to see which do
  (a leaf of one element has a share of its own shape)."""
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
