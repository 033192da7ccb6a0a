"""ChainerMN's double buffering, as optax state: exchange the previous step's gradient.

A plain data-parallel step cannot start its gradient exchange before the backward pass has
produced the gradients, so the exchange adds to the step time. ChainerMN's
``double_buffering=True`` applies the *previous* step's reduced gradient instead, and reduces
this step's gradient while the next step computes (a deep-copied model and a second CUDA
stream). Here the same schedule is functional JAX: the transformation's state holds this
rank's gradient of the previous step, unreduced (`DoubleBufferingState.pending`); ``update``
reduces *that*, returns it as the update and stores the new local gradient. The exchange
then reads only an input of the step: it depends on nothing the forward and backward pass
compute, so XLA may run it alongside them (tests/unit/test_overlap.py checks this in the
compiled step).

Checkpoints: the pending gradient is this rank's (and, for the multi-device kinds, each local
device's) own, while `mnjax.Checkpointer` saves rank 0's state and broadcasts it on restore.
(Under `mnjax.data_parallel` the optimizer state is declared replicated, so each device's own
pending gradient lives in the shard of an array whose shards differ: it stays on the devices
from step to step, but a host read of it sees device 0's.)
`mnjax.train.flush_pending` (collective, between steps) replaces it by its global sum, the
same on every rank and device, marked as reduced (`Checkpointer.save` refuses, on every
rank, a pending gradient that differs between replicas, i.e. one not flushed): the next
step applies it instead of its exchange's result. `lab.runner.train_loop` flushes before
every checkpoint and trains on with the flushed state, so a run resumed from that checkpoint
is bitwise the uninterrupted one.

What changes for the optimizer: the update at step ``t`` is the global gradient of step
``t - 1`` (one step stale, as in ChainerMN); step 0 reduces the zero-initialised state and
passes a zero gradient down the chain. ChainerMN's actual optimizer does not run at its first
step at all (its ``t`` is 0 after step 1); in an ``optax.chain`` the later links cannot be kept
from running, so there they run at step 0 on the zero gradient and stay one step ahead
(Adam's count and bias correction, schedules; weight decay applies once more).
`mnjax.optim.double_buffered_optimizer(tx, comm)` wraps `tx` and keeps its state at step 0,
as ChainerMN does (`mnjax.optim._double_buffered`). A NaN or Inf in a rank's gradient reaches the
update one step later, in the reduced sum that every rank holds alike, so `skip_nonfinite`
after the exchange still skips on every rank together; the bad gradient is then gone from
the state (the next step stores a new one).

Ordering with other in-step collectives: `mnjax.SyncBatchNorm`'s MPI collectives run inside
the forward and backward pass, and every rank must issue them and the exchange in one order
(XLA:CPU runs independent custom calls concurrently). The exchange is an `allreduce_tree`,
so it joins the step's order chain (`mnjax.comm._sequence.ORDER`): with SyncBatchNorm it
starts after the layer's last backward collective (near the end of the backward pass), and
without it (per-replica BatchNorm) it depends on nothing the step computes and may overlap
all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mnjax.comm import _buckets as bucketing
from mnjax.comm._communicator import Communicator

__all__ = ["DoubleBufferingState", "check_pending", "double_buffered_update", "init_pending"]


class DoubleBufferingState(NamedTuple):
  """State of ``allreduce_gradients(comm, double_buffering=True)``.

  Attributes:
    pending: this rank's gradient of the previous step, not yet reduced (zeros before the
      first step); the tree, shapes and dtypes of the parameters.
    reduced: a bool scalar, True when `mnjax.train.flush_pending` has already replaced
      `pending` by its global sum (then the same on every rank).
  """

  pending: Any
  reduced: jax.Array


def init_pending(params: Any) -> DoubleBufferingState:
  """A zero pending gradient shaped like `params` (what step 0 reduces and applies).

  Example:
    >>> init_pending({"w": jnp.ones(2)}).pending
    {'w': Array([0., 0.], dtype=float32)}
  """
  return DoubleBufferingState(jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), bucketing.leaf_dtype(p)), params),
      jnp.zeros((), jnp.bool_))


def check_pending(updates: Any, state: Any, caller: str) -> None:
  """Raises unless `state` is a `DoubleBufferingState` whose pending tree has the tree,
  shapes and dtypes of `updates` (runs while the step is traced).

  Example:
    >>> check_pending({"w": jnp.ones(3)}, init_pending({"w": jnp.ones(2)}), "my_fn")
    Traceback (most recent call last):
    ValueError: my_fn: leaf ['w'] is float32[3] in the gradient but float32[2] ...
  """
  if not isinstance(state, DoubleBufferingState):
    raise TypeError(
        f"{caller}: with double_buffering=True the state must be a DoubleBufferingState (from"
        f" this transformation's init), got {type(state).__name__}. Build the optimizer state"
        " with tx.init(params) of the same optax chain; a checkpoint written without double"
        " buffering cannot be resumed with it.")
  grads, _ = jax.tree_util.tree_flatten_with_path(updates)
  pending = jax.tree_util.tree_flatten_with_path(state.pending)[0]
  if jax.tree.structure(updates) != jax.tree.structure(state.pending):
    raise ValueError(
        f"{caller}: the gradient tree differs from the pending gradient's tree (the"
        f" parameters given to init): {len(grads)} leaves"
        f" {[jax.tree_util.keystr(p) for p, _ in grads][:4]}... vs {len(pending)} leaves"
        f" {[jax.tree_util.keystr(p) for p, _ in pending][:4]}.... Initialise the state with"
        " the parameters whose gradients the step passes.")
  for (path, g), (_, p) in zip(grads, pending):
    mine = (tuple(jnp.shape(g)), bucketing.leaf_dtype(g))
    held = (tuple(jnp.shape(p)), bucketing.leaf_dtype(p))
    if mine != held:
      raise ValueError(
          f"{caller}: leaf {jax.tree_util.keystr(path) or '<root>'} is"
          f" {mine[1]}{list(mine[0])} in the gradient but {held[1]}{list(held[0])} in the"
          " pending gradient of the state. Gradients must have their parameters' shapes and"
          " dtypes; initialise the state with the parameters being trained.")


def double_buffered_update(updates: Any, state: DoubleBufferingState, comm: Communicator,
                           reduce: Callable[[Any], Any], *, mean: bool = True
                           ) -> tuple[Any, DoubleBufferingState]:
  """``(reduce(state.pending), DoubleBufferingState(updates))``: the update of
  ``allreduce_gradients(comm, double_buffering=True)`` once its checks have run. A flushed
  pending sum (`mnjax.train.flush_pending`) is applied as it is (divided by the replicas for
  `mean`).

  Example:
    >>> state = init_pending({"w": jnp.ones(2)})
    >>> out, state = double_buffered_update({"w": jnp.ones(2)}, state, comm, lambda t: t)
    >>> out["w"].tolist(), state.pending["w"].tolist()      # step 0 applies zero
    ([0.0, 0.0], [1.0, 1.0])
  """
  exchanged = reduce(state.pending)
  replicas = comm.num_replicas

  def applied(exchanged, summed):  # a select: fuses with the update (no lax.cond copy)
    flushed = summed / jnp.asarray(replicas, summed.dtype) if mean else summed
    return jnp.where(state.reduced, flushed.astype(exchanged.dtype), exchanged)

  out = jax.tree.map(applied, exchanged, state.pending)
  stored = jax.tree.map(lambda g, p: jnp.asarray(g, p.dtype), updates, state.pending)
  return out, DoubleBufferingState(stored, jnp.zeros((), jnp.bool_))
