"""Data parallelism as an optax gradient transformation.

`allreduce_gradients(comm)` replaces each gradient by its mean over every replica. Put it
first in an optax chain, and the rest of the chain (momentum, Adam moments, clipping, weight
decay) sees the global gradient — so every rank applies the same update to the same
parameters and the replicas stay bitwise identical:

    tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))

The transformation is stateless (`optax.EmptyState`) and is meant to be called inside the
user's own `jax.jit` step; the MPI exchange is traced into that step (see
`mnjax.collectives.allreduce_tree`). Arguments are checked when the transformation is
built, and the gradient tree's dtypes when the step is traced — before any collective runs,
identically on every rank.
"""

from __future__ import annotations

import optax

from mnjax import collectives
from mnjax.topology import check_communicator

__all__ = ["allreduce_gradients"]


def allreduce_gradients(comm, *, mean: bool = True) -> optax.GradientTransformation:
  """Averages (or sums) gradients over all ranks: ChainerMN's multi-node optimizer as optax.

  The gradient pytree is packed into one contiguous buffer per dtype and reduced with one
  MPI allreduce each, not one call per leaf. Half-precision leaves travel as float32.

  Args:
    comm: the `Communicator` from `mnjax.create_communicator`.
    mean: average over ranks (default); ``False`` sums, e.g. when the loss is already
      normalised by the global batch size.

  Returns:
    An `optax.GradientTransformation` with `optax.EmptyState`.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1, momentum=0.9))
    >>> opt_state = tx.init(params)
    >>> @jax.jit
    ... def step(params, opt_state, batch):
    ...   grads = jax.grad(loss_fn)(params, batch)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state
  """
  check_communicator(comm, "allreduce_gradients")
  if not isinstance(mean, bool):
    raise TypeError(f"allreduce_gradients: mean must be a bool, got {mean!r}.")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    collectives.check_float_leaves(updates, "allreduce_gradients")
    return collectives.allreduce_tree(updates, comm, mean=mean), state

  return optax.GradientTransformation(init_fn, update_fn)
