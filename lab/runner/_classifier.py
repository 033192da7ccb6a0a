"""Train and eval steps for supervised classification, with or without batch statistics.

One state, one step, one evaluation for every classifier the experiments and benchmarks
train. A model whose ``__call__`` takes ``train`` (the ResNets) is initialised and
evaluated with ``train=False`` and trained with ``train=True``; when it has a
``batch_stats`` collection (BatchNorm, `mnjax.SyncBatchNorm`) the state carries it and each
step updates it. Other models (`lab.models.SmallCNN`) are called as ``model(x)``.

These are ordinary jitted JAX functions over a flax ``TrainState``; data parallelism enters
only through the optax chain the state was built with (e.g.
``optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))``). Metrics come back as
additive sums (loss sum, number correct, number of examples) so that
`mnjax.allreduce_metrics` makes them exact global figures.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _recorder as recorder
from mnjax.data import epoch_batches
from mnjax.optim.recipes import smoothed_cross_entropy
from mnjax.train import data_parallel, process_local
from mnjax.train._metrics import allreduce_metrics, global_mean

__all__ = ["TrainState", "classification_sums", "create_train_state", "eval_batches",
           "eval_step", "evaluate", "make_train_step", "step_for_kind", "train_step",
           "zero_sums"]


class TrainState(train_state.TrainState):
  """A flax ``TrainState`` plus the model's ``batch_stats`` (None when it has none).

  Attributes:
    batch_stats: the running BatchNorm statistics, updated by every train step.
    takes_train: whether the model is called with ``train=`` (static).
  """

  batch_stats: Any = None
  takes_train: bool = struct.field(pytree_node=False, default=False)


def _takes_train(model: nn.Module) -> bool:
  return "train" in inspect.signature(model.__call__).parameters


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, sample: jax.Array,
                       rng: jax.Array) -> TrainState:
  """Initialises `model` on a sample batch and wraps it with `tx` in a `TrainState`.

  The state holds the model's ``batch_stats`` when it has them (a ResNet), else None.

  Example:
    >>> model = lab.models.SmallCNN()
    >>> state = create_train_state(model, optax.adam(1e-3), jnp.zeros((1, 8, 8, 1)),
    ...                            jax.random.key(0))
    >>> int(state.step), state.batch_stats is None
    (0, True)
  """
  takes_train = _takes_train(model)
  variables = model.init(rng, sample, **({"train": False} if takes_train else {}))
  return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                           batch_stats=variables.get("batch_stats"), takes_train=takes_train)


def _apply(state: TrainState, params: Any, images: jax.Array, *, train: bool):
  """``(logits, new batch_stats or None)``; batch statistics update only when training."""
  variables = {"params": params}
  kwargs = {"train": train} if state.takes_train else {}
  if state.batch_stats is None:
    return state.apply_fn(variables, images, **kwargs), None
  variables["batch_stats"] = state.batch_stats
  if not train:
    return state.apply_fn(variables, images, **kwargs), None
  logits, new = state.apply_fn(variables, images, mutable=["batch_stats"], **kwargs)
  return logits, new["batch_stats"]


def _cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float) -> jax.Array:
  if label_smoothing:
    return smoothed_cross_entropy(logits, labels, label_smoothing)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def classification_sums(logits: jax.Array, labels: jax.Array, per_example_loss: jax.Array,
                        weights: jax.Array) -> dict[str, jax.Array]:
  """The additive metrics of a batch: ``loss_sum``, ``correct`` and ``count`` (int32),
  each example weighted by `weights` (0 for padding).

  Example:
    >>> sums = classification_sums(jnp.eye(3), jnp.array([0, 1, 0]), jnp.ones(3),
    ...                            jnp.array([1.0, 1.0, 0.0]))
    >>> float(sums["loss_sum"]), int(sums["correct"]), int(sums["count"])
    (2.0, 2, 2)
  """
  return {
      "loss_sum": jnp.sum(per_example_loss * weights),
      "correct": jnp.sum((jnp.argmax(logits, -1) == labels) * weights).astype(jnp.int32),
      "count": jnp.sum(weights).astype(jnp.int32),
  }


def zero_sums(comm: Communicator | None = None) -> dict[str, np.ndarray]:
  """`classification_sums` of no examples, with the step's dtypes (a loop's start value):
  one row per replica of this process under exact sums (``replicas=``), else scalars.

  Example:
    >>> zero_sums()["count"].dtype
    dtype('int32')
  """
  if comm is None or not comm.exact:
    return {"loss_sum": np.float32(0), "correct": np.int32(0), "count": np.int32(0)}
  rows = comm.local_device_count
  return {"loss_sum": np.zeros(rows, np.float32), "correct": np.zeros(rows, np.int32),
          "count": np.zeros(rows, np.int32)}


def _train_step(state: TrainState, images, labels, *, label_smoothing: float = 0.0,
                axis_name: str | None = None):
  weights = jnp.ones(labels.shape, jnp.float32)
  state = state.replace(step=recorder.mark_step(state.step))  # the timeline's step start

  def loss_fn(params):
    logits, batch_stats = _apply(state, params, images, train=True)
    per_example = _cross_entropy(logits, labels, label_smoothing)
    sums = classification_sums(logits, labels, per_example, weights)
    return sums["loss_sum"] / jnp.sum(weights), (sums, batch_stats)

  grads, (sums, batch_stats) = jax.grad(loss_fn, has_aux=True)(state.params)
  if axis_name is not None:  # sum over this process's local devices, inside the step
    with process_local():  # `evaluate` / the loop reduce the processes' sums after the step
      sums = jax.lax.psum(sums, axis_name)
  state = state.apply_gradients(grads=grads)
  if batch_stats is not None:
    state = state.replace(batch_stats=batch_stats)
  if recorder.active():  # the step's end, after every output (nothing traced otherwise)
    ended = recorder.mark_step(state.step, end=True, after=recorder.completion((state, sums)))
    state = state.replace(step=ended)
  return state, sums


train_step = jax.jit(_train_step, static_argnames=("label_smoothing", "axis_name"))
train_step.__doc__ = """One optimizer step on the mean loss of this rank's batch: ``(state, sums)``.

For one device per process (``flat``). For any communicator kind use `make_train_step`.

Example:
  >>> state = create_train_state(lab.models.SmallCNN(), optax.sgd(0.1),
  ...                            jnp.zeros((1, 8, 8, 1)), jax.random.key(0))
  >>> state, sums = train_step(state, jnp.zeros((4, 8, 8, 1)), jnp.zeros(4, jnp.int32))
  >>> int(state.step), int(sums["count"])
  (1, 4)
"""


def make_train_step(comm: Communicator, *, label_smoothing: float = 0.0):
  """`train_step` for `comm`'s kind: jitted (``flat``) or mapped over the local devices.

  Gradients are averaged by the `mnjax.allreduce_gradients` in the state's optax chain;
  metrics are sums over this process's examples, for every kind (reduce them with
  `allreduce_metrics`). ``label_smoothing`` > 0 trains on smoothed labels.

  Example:
    >>> step = make_train_step(comm, label_smoothing=0.1)
    >>> state = create_train_state(lab.models.SmallCNN(), optax.sgd(0.1),
    ...                            jnp.zeros((1, 8, 8, 1)), jax.random.key(0))
    >>> state, sums = step(state, jnp.zeros((4, 8, 8, 1)), jnp.zeros(4, jnp.int32))
  """
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"make_train_step: label_smoothing must be in [0, 1), got"
                     f" {label_smoothing!r}.")
  return step_for_kind(functools.partial(_train_step, label_smoothing=label_smoothing), comm)


def step_for_kind(fn, comm: Communicator):
  """A per-device ``fn(state, images, labels, axis_name=None) -> (state, metric sums)`` as
  one step over this process's batch, for `comm`'s kind; metrics summed over the process,
  or under exact sums (``replicas=``) one row per replica (`zero_sums`), which
  ``allreduce_metrics(..., per_replica=True)`` adds in the same order at any process count.

  Example:
    >>> step = step_for_kind(my_per_device_step, comm)   # doctest: +SKIP
    >>> state, sums = step(state, images, labels)        # doctest: +SKIP
  """
  if comm.exact:  # each replica's own sums: a process's sum depends on how many there are
    return data_parallel(fn, comm, batch_argnums=(1, 2), per_device_outputs=(1,))
  if not comm.multi_device:  # jax.jit, plus the check of the step's collective sequence
    return data_parallel(fn, comm, batch_argnums=(1, 2))
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
  """Sums of loss, correct predictions and examples over the entries where `mask` is True
  (running batch statistics, no label smoothing).

  Example:
    >>> state = create_train_state(lab.models.SmallCNN(), optax.sgd(0.1),
    ...                            jnp.zeros((1, 8, 8, 1)), jax.random.key(0))
    >>> sums = eval_step(state, jnp.zeros((4, 8, 8, 1)), jnp.zeros(4, jnp.int32),
    ...                  jnp.array([True, True, True, False]))
    >>> int(sums["count"])
    3
  """
  logits, _ = _apply(state, state.params, images, train=False)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return classification_sums(logits, labels, per_example, mask.astype(jnp.float32))


def eval_batches(images: np.ndarray, labels: np.ndarray, comm: Communicator,
                 global_batch_size: int) -> Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """This rank's masked ``(images, labels, mask)`` batches of a split every rank holds in
  full: each example once over all ranks, one static batch shape (the last batch padded).

  Example:
    >>> x, y = np.zeros((10, 8, 8, 1), np.float32), np.zeros(10, np.int32)
    >>> [int(mask.sum()) for _, _, mask in eval_batches(x, y, comm, 4)]
    [4, 4, 2]
  """
  for idx, mask in epoch_batches(len(labels), comm, global_batch_size, shuffle=False,
                                 drop_remainder=False):
    yield images[idx], labels[idx], mask


def evaluate(state: TrainState, batches: Iterable, comm: Communicator) -> dict:
  """Exact loss and accuracy over masked batches: ``(images, labels, mask, ...)`` tuples,
  as `eval_batches` or an evaluation `mnjax.data.Loader`'s ``epoch(0)`` yield them.

  Padding (mask False) is left out; the sums are reduced once with `allreduce_metrics`.
  Collective: call on every rank.

  Returns:
    ``{"loss": mean loss, "correct": accuracy, "count": number of examples}``.

  Example:
    >>> state = create_train_state(lab.models.SmallCNN(), optax.sgd(0.1),
    ...                            jnp.zeros((1, 8, 8, 1)), jax.random.key(0))
    >>> x, y = np.zeros((10, 8, 8, 1), np.float32), np.zeros(10, np.int32)
    >>> evaluate(state, eval_batches(x, y, comm, 4), comm)["count"]
    10
  """
  step = _replica_eval_step(comm) if comm.exact else eval_step
  # jax arrays from the start: 0-d numpy arrays added to the step's sums here went with heap
  # corruption under mpirun -n 2 (docs/design/allreduce.md, section 2b: not understood yet).
  totals = jax.tree.map(lambda z: jnp.array(z, copy=True), zero_sums(comm))
  for images, labels, mask, *_ in batches:
    totals = jax.tree.map(lambda a, b: a + b, totals, step(state, images, labels, mask))
  return global_mean(allreduce_metrics(totals, comm, per_replica=comm.exact))


@functools.cache
def _replica_eval_step(comm: Communicator):
  """`eval_step` on each replica's share of the batch: one row of sums per replica."""
  mapped = data_parallel(lambda *args: (eval_step(*args),), comm, batch_argnums=(1, 2, 3),
                         per_device_outputs=(0,))
  return lambda *args: mapped(*args)[0]
