"""Train and eval steps for supervised classification, shared by experiments and benchmarks.

These are ordinary jitted JAX functions over a `flax.training.train_state.TrainState`;
data parallelism enters only through the optax chain the state was built with (e.g.
``optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))``). Metrics come back as
additive sums (loss sum, number correct, number of examples) so that
`mnjax.allreduce_metrics` can make them exact global figures.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from mnjax.data._sharding import epoch_batches
from mnjax.train._metrics import allreduce_metrics, global_mean
from mnjax.train._parallel import data_parallel
from mnjax.comm._communicator import Communicator

__all__ = ["create_train_state", "train_step", "make_train_step", "step_for_kind", "eval_step",
           "evaluate"]


def create_train_state(
    model: nn.Module, tx: optax.GradientTransformation, sample: jnp.ndarray, rng: jax.Array
) -> TrainState:
  """Initialises `model` on a sample batch and wraps it with `tx` in a `TrainState`.

  Example:
    >>> state = create_train_state(SmallCNN(), tx, jnp.zeros((1, 8, 8, 1)), jax.random.key(0))
  """
  params = model.init(rng, sample)["params"]
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _loss_and_metrics(params, apply_fn, images, labels, weights):
  logits = apply_fn({"params": params}, images)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels) * weights
  metrics = {
      "loss_sum": jnp.sum(per_example * weights),
      "correct": jnp.sum(correct).astype(jnp.int32),
      "count": jnp.sum(weights).astype(jnp.int32),
  }
  return jnp.sum(per_example * weights) / jnp.sum(weights), metrics


def _train_step(state: TrainState, images, labels, axis_name: str | None = None):
  weights = jnp.ones(labels.shape, jnp.float32)
  grads, metrics = jax.grad(_loss_and_metrics, has_aux=True)(
      state.params, state.apply_fn, images, labels, weights
  )
  if axis_name is not None:  # sum over this process's local devices, inside the step
    metrics = jax.lax.psum(metrics, axis_name)
  return state.apply_gradients(grads=grads), metrics


train_step = jax.jit(_train_step, static_argnames="axis_name")
train_step.__doc__ = """One optimizer step on the mean loss of this rank's batch -> ``(state, metrics)``.

For one device per process (``flat``). For any communicator kind use `make_train_step`.

Example:
  >>> state, metrics = train_step(state, images, labels)
"""


def make_train_step(comm: Communicator):
  """`train_step` for `comm`'s kind: jitted (``flat``) or mapped over the local devices.

  Metrics are sums over this process's examples, for every kind.

  Example:
    >>> step = make_train_step(comm)
    >>> state, metrics = step(state, images, labels)   # this process's batch
  """
  if not comm.multi_device:
    return train_step
  return step_for_kind(_train_step, comm)


def step_for_kind(fn, comm: Communicator):
  """A per-device ``fn(state, images, labels, axis_name=None) -> (state, metric sums)`` as
  one step over this process's batch, for `comm`'s kind; metrics summed over the process.

  Example:
    >>> step = step_for_kind(my_per_device_step, comm)
    >>> state, sums = step(state, images, labels)
  """
  if not comm.multi_device:
    return jax.jit(fn)
  if comm.kind != "xla":
    # The local axis spans this process's devices: psum gives the process's sums. (Summing
    # per-device outputs afterwards would add a separate multi-device program between
    # steps; keeping the reduction inside the step keeps one program per step.)
    return data_parallel(
        functools.partial(fn, axis_name=comm.axis_name), comm, batch_argnums=(1, 2)
    )
  # xla: the axis spans every process, so take per-device rows and add this process's.
  mapped = data_parallel(fn, comm, batch_argnums=(1, 2), per_device_outputs=(1,))

  def step(state, images, labels):
    state, per_device = mapped(state, images, labels)
    return state, jax.tree.map(lambda x: x.sum(0), per_device)

  return step


@jax.jit
def eval_step(state: TrainState, images: jax.Array, labels: jax.Array, mask: jax.Array):
  """Sums of loss, correct predictions and examples over the entries where `mask` is True.

  Example:
    >>> sums = eval_step(state, x[idx], y[idx], mask)   # then mnjax.allreduce_metrics
  """
  _, metrics = _loss_and_metrics(
      state.params, state.apply_fn, images, labels, mask.astype(jnp.float32)
  )
  return metrics


def evaluate(
    state: TrainState,
    images: np.ndarray,
    labels: np.ndarray,
    comm: Communicator,
    global_batch_size: int,
) -> dict:
  """Exact loss and accuracy over a whole split held (in full) by every rank.

  Each rank evaluates its shard in fixed-shape batches; padding and the duplicates of
  equal-length shards are masked out; the sums are reduced once with `allreduce_metrics`.
  Collective: call on every rank.

  Returns:
    ``{"loss": mean loss, "correct": accuracy, "count": number of examples}``.

  Example:
    >>> evaluate(state, test.images, test.labels, comm, 256)["correct"]   # accuracy
    0.9694
  """
  totals = {"loss_sum": 0.0, "correct": 0, "count": 0}
  for idx, mask in epoch_batches(
      len(labels), comm, global_batch_size, shuffle=False, drop_remainder=False
  ):
    sums = eval_step(state, images[idx], labels[idx], mask)
    totals = jax.tree.map(lambda a, b: a + b, totals, sums)
  return global_mean(allreduce_metrics(totals, comm))
