"""Double buffering's pending gradients, made whole before a checkpoint (`flush_pending`).

`mnjax.Checkpointer` saves rank 0's state, but each replica's pending gradient is its own:
`flush_pending` replaces them by their global sum, between steps, with one small
`data_parallel` program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _allreduce as collectives
from mnjax.optim._double_buffering import PendingGradient
from mnjax.train._parallel import data_parallel

__all__ = ["flush_pending"]


def _is_state(x: Any) -> bool:
  return isinstance(x, PendingGradient)


def flush_pending(opt_state: Any, comm: Communicator) -> Any:
  """`opt_state` with every double-buffered pending gradient replaced by its sum over
  all replicas (marked ``reduced``): the same on every rank and device, so that
  `mnjax.Checkpointer` (rank 0 writes; restore broadcasts) keeps it whole.

  Collective: call on every rank between steps, with the state the last step returned. The
  next step applies the flushed sum instead of its own exchange's result; train on with the
  returned state (`lab.runner.train_loop` does, before every checkpoint), so that a run
  resumed from it is bitwise the uninterrupted one. (The flushed sum is a float32-exact
  exchange on its own buckets: within rounding of what the step would have exchanged.)

  Example:
    >>> tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1), comm, double_buffering=True)
    >>> params = {"w": jnp.ones(2)}
    >>> _, state = jax.jit(tx.update)({"w": jnp.ones(2)}, tx.init(params), params)
    >>> flushed = mnjax.train.flush_pending(state, comm).exchange
    >>> bool(flushed.reduced), flushed.pending["w"].tolist() == [comm.size * 1.0] * 2
    (True, True)
  """
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
  if not found:
    raise ValueError("flush_pending: opt_state holds no double-buffered pending gradient, so"
                     " there is nothing to flush (only a state of"
                     " mnjax.create_multi_node_optimizer(tx, comm, double_buffering=True) has"
                     " one); call it only on such a state.")
  summed = iter(_summing(comm)([(s.pending, s.reduced) for s in found]))
  flag = jnp.ones((), jnp.bool_)
  return jax.tree.map(lambda s: PendingGradient(next(summed), flag) if _is_state(s) else s,
                      opt_state, is_leaf=_is_state)


@functools.cache
def _summing(comm: Communicator) -> Callable[[Any], Any]:
  """Global sums of a list of pending trees, each device reducing its own (mapped for the
  multi-device kinds). An already flushed tree is the same everywhere: summing it again
  would multiply it, so it is kept."""
  def total(pendings):
    sums = collectives.allreduce_tree([p for p, _ in pendings], comm, mean=False,
                                      bucket_bytes=None)
    return [jax.tree.map(lambda s, p, f=flag: jnp.where(f, p, s), summed, pending)
            for summed, (pending, flag) in zip(sums, pendings)]

  return data_parallel(total, comm, batch_argnums=())
