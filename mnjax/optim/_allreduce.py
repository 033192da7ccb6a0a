"""Data parallelism as an optax gradient transformation.

`allreduce_gradients(comm)` replaces each gradient by its mean over every replica. Put it
first in an optax chain, and the rest of the chain (momentum, Adam moments, clipping, weight
decay) sees the global gradient — so every rank applies the same update to the same
parameters and the replicas stay bitwise identical:

    tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))

The transformation is stateless (`optax.EmptyState`) and is meant to be called inside the
user's own `jax.jit` step; the MPI exchange is traced into that step (see
`mnjax.comm.allreduce_tree`). Arguments are checked when the transformation is
built, parameter dtypes at ``init``. When the step is traced, every rank checks its gradient
tree and, across ranks, that all ranks trace the same gradient and parameter trees with the
same options (`mnjax.guard.check_same_on_all_ranks`) — before any collective runs, with the
same error on every rank.

Gradient accumulation: do not wrap the chain in `optax.MultiSteps`, which runs its inner
chain on every micro-step and masks the result, so the allreduce inside it exchanges
gradients ``k`` times per update. `mnjax.accumulate_gradients` runs the chain only on the
``k``-th micro-step, on the mean gradient: one exchange per update::

    tx = mnjax.accumulate_gradients(
        optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3)), every_k=k)
"""

from __future__ import annotations

from typing import Any

import optax

from mnjax.comm import _collectives as collectives
from mnjax.comm import _wire as wire
from mnjax.comm._communicator import check_communicator
from mnjax.guard import _preflight as preflight

__all__ = ["allreduce_gradients"]


def allreduce_gradients(comm, *, mean: bool = True, wire_dtype: Any = None,
                        bucket_bytes: int | str | None = "auto",
                        preflight_timeout: float = preflight.DEFAULT_TIMEOUT,
                        ) -> optax.GradientTransformation:
  """Averages (or sums) gradients over all replicas: ChainerMN's multi-node optimizer as optax.

  The gradient pytree is packed into contiguous buffers (buckets of at most `bucket_bytes`
  per dtype) and reduced with one MPI allreduce each, not one call per leaf.
  Half-precision leaves travel as float32 unless a half-precision `wire_dtype` is asked for.

  Args:
    comm: the `Communicator` from `mnjax.create_communicator`.
    mean: average over replicas (default); ``False`` sums, e.g. when the loss is already
      normalised by the global batch size.
    wire_dtype: None (full precision) or ``jnp.bfloat16`` / ``jnp.float16``: ChainerMN's
      ``allreduce_grad_dtype``. Gradients cross processes in 16 bits (half the bytes) and
      are summed in float32; the error bound is in `mnjax.comm._wire`. bfloat16 keeps float32's
      range; float16 is 8x more precise but gives Inf where the mean gradient exceeds
      65504 (never a silent finite value).
    bucket_bytes: the largest fused buffer in wire bytes, like PyTorch DDP's
      ``bucket_cap_mb`` and Horovod's fusion threshold; a larger leaf travels alone,
      unpacked. ``"auto"`` (default): the cap chosen for the communicator's platform
      (`mnjax.comm.default_bucket_bytes`: measured on CPU with ``python -m
      mnjax.bench allreduce``, from the cost model on GPU); None fuses each dtype into one
      buffer (fewest calls: ChainerMN's behaviour).
    preflight_timeout: seconds a rank waits, when the step is first traced, for every
      other rank to reach the same pre-flight check (`mnjax.guard._preflight`); then it raises
      instead of hanging.

  Returns:
    An `optax.GradientTransformation` with `optax.EmptyState`.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm, wire_dtype=jnp.bfloat16),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> def loss_fn(params, x):
    ...   return jnp.mean((x @ params["w"]) ** 2)
    >>> params = {"w": jnp.ones(3)}
    >>> opt_state = tx.init(params)
    >>> @jax.jit
    ... def step(params, opt_state, batch):
    ...   grads = jax.grad(loss_fn)(params, batch)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> params, opt_state = step(params, opt_state, jnp.ones((4, 3)))
    >>> [round(w, 3) for w in params["w"].tolist()]     # 1 - 0.1 x the mean gradient, 6
    [0.4, 0.4, 0.4]
  """
  caller = "allreduce_gradients"
  check_communicator(comm, caller)
  if not isinstance(mean, bool):
    raise TypeError(f"{caller}: mean must be a bool, got {mean!r}.")
  wire_dtype = wire.check_wire_dtype(wire_dtype, caller)
  bucket_bytes = collectives.check_bucket_bytes(bucket_bytes, caller, comm)
  real = wire_dtype is not None
  if not isinstance(preflight_timeout, (int, float)) or not preflight_timeout > 0:
    raise ValueError(f"{caller}: preflight_timeout must be a positive number of seconds,"
                     f" got {preflight_timeout!r}.")
  options = {"communicator kind": comm.kind, "replicas": comm.num_replicas, "mean": mean,
             "wire_dtype": str(wire_dtype), "bucket_bytes": bucket_bytes}

  def init_fn(params):
    # Parameters and their gradients share dtypes: refuse what cannot be reduced now,
    # when the optimizer is built, rather than at the first step.
    collectives.check_float_leaves(params, caller, real=real)
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    collectives.check_float_leaves(updates, caller, real=real)
    # Runs in Python while the step is traced: once per compilation, not per step.
    signature = dict(options, **{"gradient tree": preflight.tree_signature(updates)})
    if params is not None:
      signature["parameter tree"] = preflight.tree_signature(params)
    preflight.check_same_on_all_ranks(
        comm, "the gradients to exchange", signature, caller=caller,
        timeout=preflight_timeout)
    reduced = collectives.allreduce_tree(
        updates, comm, mean=mean, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes)
    return reduced, state

  return optax.GradientTransformation(init_fn, update_fn)
