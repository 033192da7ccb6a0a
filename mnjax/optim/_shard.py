"""Optimizer-state sharding (ZeRO stage 1) as one optax transformation (docs/design/optim.md)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _allreduce as allreduce
from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep import _primitives as mpi_ops
from mnjax.comm._instep import _scatter as scatter
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep import _wire as wire
from mnjax.guard import _preflight as preflight
from mnjax.guard import _program as program
from mnjax.optim._shard_checks import (
  NEEDS_WHOLE_TREE,
  check_elementwise_on_shares,
  whole_tree_transformations,
)
from mnjax.optim._shard_state import ShardedState, check_state, sharded_state

__all__ = ["shard_optimizer"]


def shard_optimizer(tx: optax.GradientTransformation, comm, *, wire_dtype: Any = None,
                    bucket_bytes: int | str | None = "auto",
                    clip_global_norm: float | None = None, check_elementwise: bool = True,
                    preflight_timeout: float = preflight.DEFAULT_TIMEOUT,
                    ) -> optax.GradientTransformation:
  """ZeRO-1: `tx` with its state sharded over the ranks; replaces ``chain(allreduce, tx)``.

  A step reduce-scatters the gradients, runs `tx` on this rank's 1-D share of every leaf
  (its `ShardedState`), and all-gathers the updates. On an exact communicator
  (``replicas=``) the step instead takes its share of the exact mean, as
  `allreduce_gradients` computes it, so the updates have the same bits on any number of
  processes, and the state, saved whole, resumes on another.

  Args:
    tx: the optimizer to shard, elementwise; known whole-tree transformations are refused.
    comm: a ``flat`` `Communicator` (one process per device), or any kind with
      ``replicas=``: the state is sharded over the processes, the same on their devices.
    wire_dtype: None or ``jnp.bfloat16`` / ``jnp.float16``: the gradients' reduce-scatter in
      16 bits with float32 sums; updates are all-gathered in their own dtype.
    bucket_bytes, preflight_timeout: as in `allreduce_gradients`.
    clip_global_norm: clip the mean gradient to this global norm before `tx` (exact on shares).
    check_elementwise: at ``init``, probe that `tx` gives the same results on shares.

  Example:
    >>> tx = mnjax.shard_optimizer(optax.adam(0.1), comm)
    >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(5)}
    >>> opt_state = tx.init(params)
    >>> opt_state.inner[0].mu["w"].shape == (-(-6 // comm.size),)   # this rank's share
    True
    >>> @jax.jit
    ... def step(params, opt_state):
    ...   grads = jax.tree.map(jnp.ones_like, params)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> params, opt_state = step(params, opt_state)
    >>> [round(x, 3) for x in params["b"].tolist()]
    [-0.1, -0.1, -0.1, -0.1, -0.1]
  """
  caller = "shard_optimizer"
  if isinstance(tx, Communicator):
    raise TypeError(f"{caller}: the wrapped transformation comes first, as in optax's wrappers:"
                    f" {caller}(tx, comm), got a Communicator as the first argument.")
  check_communicator(comm, caller)
  if comm.kind != "flat" and not comm.exact:
    raise ValueError(
        f"{caller}: kind {comm.kind!r} is not supported without replicas=; shard_optimizer"
        " shards the optimizer state over ranks of a 'flat' communicator (one process per"
        " device), or over the processes of a communicator with exact sums"
        f" (create_communicator({comm.kind!r}, replicas=V)). Use create_communicator('flat')"
        " with one process per device, pass replicas=, or use"
        " optax.chain(mnjax.allreduce_gradients(comm), tx) (unsharded state).")
  if not (isinstance(tx, tuple) and callable(getattr(tx, "init", None))
          and callable(getattr(tx, "update", None))):
    raise TypeError(f"{caller}: tx must be an optax.GradientTransformation (e.g."
                    f" optax.adam(1e-3)), got {type(tx).__name__} ({tx!r:.80}).")
  refused = whole_tree_transformations(tx)
  if refused:
    raise ValueError(
        f"{caller}: tx contains {', '.join(repr(n) for n in refused)}, which "
        + "; ".join(f"{n} needs {NEEDS_WHOLE_TREE[n]}" for n in refused)
        + ". Each rank runs tx on its share of every leaf only, so it would silently"
        " compute something else.")
  wire_dtype = wire.check_wire_dtype(wire_dtype, caller)
  if comm.exact and wire_dtype is not None:
    raise ValueError(
        f"{caller}: wire_dtype={wire_dtype} rounds each gradient to 16 bits, but this"
        " communicator promises exact sums (create_communicator(..., replicas=...)): the"
        " same bits on any number of processes. Drop wire_dtype, or replicas=.")
  bucket_bytes = bucketing.check_bucket_bytes(bucket_bytes, caller, comm)
  if clip_global_norm is not None and (
      isinstance(clip_global_norm, bool) or not isinstance(clip_global_norm, (int, float))
      or not clip_global_norm > 0):
    raise ValueError(f"{caller}: clip_global_norm must be None or a positive number, got"
                     f" {clip_global_norm!r}.")
  if not isinstance(check_elementwise, bool):
    raise TypeError(f"{caller}: check_elementwise must be a bool, got {check_elementwise!r}.")
  if not isinstance(preflight_timeout, (int, float)) or not preflight_timeout > 0:
    raise ValueError(f"{caller}: preflight_timeout must be a positive number of seconds,"
                     f" got {preflight_timeout!r}.")
  real = wire_dtype is not None
  index, parts = comm.rank, comm.size
  options = {"communicator kind": comm.kind, "replicas": comm.num_replicas,
             "wire_dtype": str(wire_dtype), "bucket_bytes": bucket_bytes,
             "clip_global_norm": clip_global_norm}

  def init_fn(params):
    bucketing.check_float_leaves(params, caller, real=real)
    if check_elementwise:
      check_elementwise_on_shares(tx, params, caller=caller)
    # One compiled cut, not one eager pad-and-slice per leaf.
    shares = jax.jit(lambda p: _shares(p, index, parts))(params)
    return sharded_state(tx, params, tx.init(shares), index, parts, caller=caller)

  def update_fn(updates, state, params=None):
    bucketing.check_float_leaves(updates, caller, real=real)
    check_state(state, index, parts, caller)
    signature = dict(options, **{"gradient tree": preflight.tree_signature(updates),
                                 "optimizer state (shares)": preflight.tree_signature(
                                     state.inner)})
    if params is not None:
      signature["parameter tree"] = preflight.tree_signature(params)
    if sequence.enclosing_options():  # e.g. accumulate_gradients' every_k
      signature["enclosing transformations"] = sequence.enclosing_options()
    preflight.check_same_on_all_ranks(
        comm, "the gradients and sharded optimizer state", signature, caller=caller,
        timeout=preflight_timeout)
    if comm.exact:  # this process's share of the exact mean: the same bits on any layout
      mean = allreduce.allreduce_tree(updates, comm, bucket_bytes=bucket_bytes)
      if clip_global_norm is not None:
        mean, _ = _clip(mean, clip_global_norm, None, None)  # the whole tree: on every rank
      grads, last = _shares(mean, index, parts), None
    else:
      grads, last = scatter.reduce_scatter_tree(
          updates, comm, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes)
      if wire_dtype is not None:  # the share is float32: tx sees the gradients' own dtypes
        grads = jax.tree.map(lambda s, g: s.astype(jnp.asarray(g).dtype), grads, updates)
      if clip_global_norm is not None:
        grads, last = _clip(grads, clip_global_norm, comm, last)
    shares = None if params is None else _shares(params, index, parts)
    # Another hyperparameter on one rank would be invisible to check_replicas: compare programs.
    program.check_same_program(
        comm, jax.make_jaxpr(tx.update)(grads, state.inner, shares), caller=caller,
        what="the update of the optimizer it shards (tx)")
    new, inner = tx.update(grads, state.inner, shares)
    _check_shares(new, updates, parts, caller)
    full, _ = scatter.allgather_tree(new, updates, comm, bucket_bytes=bucket_bytes, after=last)
    return full, ShardedState(inner, index, parts, state.layout)

  return optax.GradientTransformation(init_fn, update_fn)


def _shares(tree: Any, index: int, parts: int) -> Any:
  """Share `index` of `parts` of every leaf (rank-dependent by design: shapes are compared)."""
  with program.rank_dependent():
    return jax.tree.map(lambda x: scatter.shard_leaf(x, index, parts), tree)


def _clip(grads: Any, max_norm: float, comm, after: Any) -> tuple[Any, Any]:
  """``optax.clip_by_global_norm`` on shares: the squared norm summed over every rank (`comm`;
  None: `grads` is the whole tree)."""
  leaves = jax.tree.leaves(grads)
  partial = sum((jnp.sum(jnp.real(x * jnp.conj(x))).astype(jnp.float32) for x in leaves),
                jnp.zeros((), jnp.float32))
  if comm is not None and comm.size > 1:
    every = mpi_ops.allgather(partial.reshape(1), comm.device_comm, after)  # (P, 1)
    after = every
    partial = every[0, 0]
    for r in range(1, comm.size):  # rank order: the same norm on every rank
      partial = partial + every[r, 0]
  norm = jnp.sqrt(partial)
  trigger = norm < max_norm
  clipped = jax.tree.map(
      lambda t: jnp.where(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)
  return clipped, after


def _check_shares(new: Any, updates: Any, parts: int, caller: str) -> None:
  """tx returned 1-D shares of the gradients' leaves (static shapes: checked when traced)."""
  leaves, treedef = jax.tree.flatten(updates)
  try:
    got = treedef.flatten_up_to(new)
  except (ValueError, TypeError) as error:
    raise ValueError(f"{caller}: tx returned updates with another tree structure than the"
                     f" gradients ({error}); it must return one update per gradient"
                     " leaf.") from error
  for path, g, u in zip(preflight.tree_signature(updates), leaves, got):
    want = (scatter.share_size(np.size(g), parts),)
    if tuple(np.shape(u)) != want:
      raise ValueError(f"{caller}: tx returned an update of shape {tuple(np.shape(u))} for"
                       f" the share of leaf {path[0]}, expected {want}.")
