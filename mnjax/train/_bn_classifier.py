"""Train and eval steps for classifiers with batch normalization (ResNets), any comm kind.

Like `mnjax.train._classifier`, but the state also carries the ``batch_stats`` collection, the loss
may use label smoothing, and evaluation reads a `mnjax.data.Loader`. With
`mnjax.SyncBatchNorm` layers the statistics are those of the global batch and stay identical
on every replica; with flax's ``nn.BatchNorm`` each replica normalises with its own examples
(ChainerMN's default) and `mnjax.allreduce_persistent` can average the running statistics.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from mnjax.train._classifier import step_for_kind
from mnjax.train._metrics import allreduce_metrics, global_mean
from mnjax.optim.recipes import smoothed_cross_entropy
from mnjax.comm._communicator import Communicator

__all__ = ["BatchNormState", "create_state", "make_train_step", "eval_step", "evaluate"]


class BatchNormState(TrainState):
  """A flax `TrainState` plus the model's ``batch_stats`` (running BN statistics)."""

  batch_stats: Any = None


def create_state(model: nn.Module, tx: optax.GradientTransformation, sample: jax.Array,
                 rng: jax.Array) -> BatchNormState:
  """Initialises `model` (called as ``model(x, train=...)``) and wraps it with `tx`.

  Example:
    >>> state = create_state(ResNet18(num_classes=10, stem="cifar"), tx, x[:1], key)
  """
  variables = model.init(rng, sample, train=False)
  return BatchNormState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                               batch_stats=variables.get("batch_stats", {}))


def _metrics(logits, labels, per_example, weights):
  return {
      "loss_sum": jnp.sum(per_example * weights),
      "correct": jnp.sum((jnp.argmax(logits, -1) == labels) * weights).astype(jnp.int32),
      "count": jnp.sum(weights).astype(jnp.int32),
  }


def _train_step(state: BatchNormState, images, labels, *, smoothing: float,
                axis_name: str | None = None):
  def loss_fn(params):
    logits, new = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, images,
                                 train=True, mutable=["batch_stats"])
    per_example = smoothed_cross_entropy(logits, labels, smoothing)
    return per_example.mean(), (logits, new["batch_stats"], per_example)

  grads, (logits, stats, per_example) = jax.grad(loss_fn, has_aux=True)(state.params)
  metrics = _metrics(logits, labels, per_example, jnp.ones(labels.shape, jnp.float32))
  if axis_name is not None:
    metrics = jax.lax.psum(metrics, axis_name)
  return state.apply_gradients(grads=grads).replace(batch_stats=stats), metrics


def make_train_step(comm: Communicator, *, label_smoothing: float = 0.0):
  """One optimizer step on this process's batch -> ``(state, metric sums)``, for `comm`'s kind.

  Gradients are averaged by the `mnjax.allreduce_gradients` in the state's optax chain;
  metrics are sums over this process's examples (reduce them with `allreduce_metrics`).

  Example:
    >>> step = make_train_step(comm, label_smoothing=0.1)
    >>> state, sums = step(state, batch.images, batch.labels)
  """
  return step_for_kind(functools.partial(_train_step, smoothing=label_smoothing), comm)


@jax.jit
def eval_step(state: BatchNormState, images, labels, mask):
  """Sums of loss, correct predictions and examples where `mask`, with running statistics.

  Example:
    >>> sums = eval_step(state, batch.images, batch.labels, batch.mask)
  """
  logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, images,
                          train=False)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return _metrics(logits, labels, per_example, mask.astype(jnp.float32))


def evaluate(state: BatchNormState, loader, comm: Communicator, epoch: int = 0) -> dict:
  """Exact loss and top-1 accuracy over an evaluation `mnjax.data.Loader` (every example
  once over all ranks). Collective: call on every rank.

  Example:
    >>> evaluate(state, test_loader, comm)["correct"]    # top-1 accuracy
  """
  totals = {"loss_sum": 0.0, "correct": 0, "count": 0}
  for batch in loader.epoch(epoch):
    sums = eval_step(state, batch.images, batch.labels, batch.mask)
    totals = jax.tree.map(lambda a, b: a + b, totals, sums)
  return global_mean(allreduce_metrics(totals, comm))
