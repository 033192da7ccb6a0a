"""The optimizer `lab.runner.train_loop` expects, and the count of the steps it skipped.

`guarded_optimizer` chains the gradient exchange the config asks for (`allreduce_gradients`,
`shard_optimizer` or ChainerMN's double buffering) with `mnjax.skip_nonfinite`, so that
every rank skips a non-finite step together; `skipped_steps` finds the skip counters by
type anywhere in an optimizer state (the loop's divergence check and each epoch's record).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from lab.runner._run_config import RunConfig
from mnjax.comm import Communicator, bucket_bytes_from_mb
from mnjax.optim import (
  SkipNonFiniteState,
  allreduce_gradients,
  create_multi_node_optimizer,
  local_sgd,
  shard_optimizer,
  skip_nonfinite,
)

__all__ = ["guarded_optimizer", "skipped_steps"]


def guarded_optimizer(optimizer: optax.GradientTransformation, comm: Communicator,
                      config: RunConfig) -> optax.GradientTransformation:
  """``optax.chain(allreduce_gradients(comm, ...), skip_nonfinite(optimizer))`` with the
  config's wire dtype and buckets: the chain `train_loop` expects. After the allreduce every
  rank holds the same gradient, so all skip a non-finite step together. With
  ``config.shard_optimizer``: ``skip_nonfinite(shard_optimizer(optimizer, comm, ...),
  on="update")`` (the all-gathered update is the same on every rank). With
  ``config.double_buffering``: ``create_multi_node_optimizer(skip_nonfinite(optimizer), comm,
  double_buffering=True, ...)``, ChainerMN's (the optimizer first runs at the second step).
  With ``config.local_sgd`` K: ``local_sgd(skip_nonfinite(optimizer), comm, every_k=K, ...)``
  (each replica skips its own non-finite steps).

  Example:
    >>> config = RunConfig(epochs=1, global_batch_size=8, workdir="runs/x")
    >>> tx = guarded_optimizer(optax.adam(1e-3), comm, config)
  """
  if config.shard_optimizer:
    sharded = shard_optimizer(optimizer, comm, wire_dtype=config.wire_dtype,
                              bucket_bytes=bucket_bytes_from_mb(config.bucket_mb))
    return skip_nonfinite(sharded, on="update")
  options = dict(wire_dtype=config.wire_dtype, bucket_bytes=bucket_bytes_from_mb(config.bucket_mb))
  if config.local_sgd:
    return local_sgd(skip_nonfinite(optimizer), comm, every_k=config.local_sgd, **options)
  if config.double_buffering:
    return create_multi_node_optimizer(skip_nonfinite(optimizer), comm, double_buffering=True,
                                       **options)
  return optax.chain(allreduce_gradients(comm, **options), skip_nonfinite(optimizer))


def _skip_states(opt_state: Any) -> list[SkipNonFiniteState]:
  found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SkipNonFiniteState))
  return [s for s in found if isinstance(s, SkipNonFiniteState)]


def skipped_steps(opt_state: Any) -> int:
  """Steps `mnjax.skip_nonfinite` skipped so far, found by type anywhere in `opt_state`.

  Example:
    >>> tx = optax.chain(mnjax.skip_nonfinite(optax.sgd(0.1)))
    >>> skipped_steps(tx.init({"w": jnp.zeros(2)}))
    0
  """
  states = _skip_states(opt_state)
  if not states:
    raise ValueError("skipped_steps: the optimizer state holds no skip_nonfinite state; build"
                     " the optimizer with lab.runner.guarded_optimizer (or wrap it in"
                     " mnjax.skip_nonfinite).")
  return sum(int(s.skipped) for s in states)
