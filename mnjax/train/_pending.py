"""Double buffering's pending gradients, made whole before a checkpoint (`flush_pending`)."""

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
  """`opt_state` with every double-buffered pending gradient replaced by its sum over all
  replicas (marked ``reduced``), so that `mnjax.Checkpointer` (rank 0 writes) keeps it whole.

  Collective: call on every rank between steps and train on with the returned state, so a
  run resumed from the checkpoint is bitwise the uninterrupted one.

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
  """Global sums of a list of pending trees; an already flushed tree is kept as it is."""
  def total(pendings):
    sums = collectives.allreduce_tree([p for p, _ in pendings], comm, mean=False,
                                      bucket_bytes=None)
    return [jax.tree.map(lambda s, p, f=flag: jnp.where(f, p, s), summed, pending)
            for summed, (pending, flag) in zip(sums, pendings)]

  return data_parallel(total, comm, batch_argnums=())
