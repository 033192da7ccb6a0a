"""The flax models: the reference architectures' exact parameter counts, both stems, the
zero-initialised residual branches, and the classifier state that carries batch statistics
only for the models that have them."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lab.models import ResNet18, ResNet50, SmallCNN
from lab.runner import create_train_state, eval_step, train_step


def param_count(model, size):
  variables = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False))
  leaves = jax.tree.leaves(variables["params"])
  return len(leaves), sum(math.prod(x.shape) for x in leaves)


@pytest.mark.parametrize("model, leaves, count", [
    (ResNet18(), 62, 11_689_512),   # torchvision resnet18
    (ResNet50(), 161, 25_557_032),  # torchvision resnet50
    (ResNet18(num_classes=10, stem="cifar"), 62, 11_173_962),
])
def test_parameter_counts_match_the_reference_architectures(model, leaves, count):
  assert param_count(model, 224 if model.stem == "imagenet" else 32) == (leaves, count)


@pytest.fixture(scope="module")
def cifar_state():
  """A CIFAR ResNet-18's train state on 8 x 8 images, built once for this module's tests.

  Jitted, from an ``rbg`` key: ResNet-18's threefry initialisers cost about 10 s of CPU to
  compile (op by op or jitted), rbg's about 3 s. Nothing here depends on the random values.
  """
  model = ResNet18(num_classes=10, stem="cifar")
  return jax.jit(functools.partial(create_train_state, model, optax.sgd(0.1),
                                   jnp.zeros((1, 8, 8, 3))))(jax.random.key(0, impl="rbg"))


def variables_of(state):
  return {"params": state.params, "batch_stats": state.batch_stats}


@functools.cache
def train_apply(model):
  """``model.apply`` in training mode (updating the batch statistics), jitted once per model."""
  return jax.jit(lambda variables, x: model.apply(variables, x, train=True,
                                                  mutable=["batch_stats"]))


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_cifar_resnet_updates_its_batch_statistics_and_zero_initialises_residual_scales(
    cifar_state):
  variables = variables_of(cifar_state)
  x = np.random.default_rng(1).normal(size=(4, 8, 8, 3)).astype(np.float32)
  logits, updates = train_apply(ResNet18(num_classes=10, stem="cifar"))(variables, x)
  assert logits.shape == (4, 10) and np.all(np.isfinite(logits))
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), variables["batch_stats"],
                         updates["batch_stats"])
  assert all(jax.tree.leaves(changed))
  # Goyal et al.: the last norm scale of every residual block starts at zero.
  flat = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
  scales = [leaf for path, leaf in flat
            if "BatchNorm_1" in jax.tree_util.keystr(path)
            and "BasicBlock" in jax.tree_util.keystr(path)]
  assert scales and all(np.all(s == 0) for s in scales)


def test_unknown_stem_is_refused():
  with pytest.raises(ValueError, match="stem must be one of"):
    ResNet18(stem="tiny").init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)


def test_resnet_bn_momentum_zero_keeps_only_the_last_batch_statistics(cifar_state):
  x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype(np.float32)
  variables = variables_of(cifar_state)  # bn_momentum changes no variable
  for momentum, forgets in ((0.0, True), (0.9, False)):
    apply = train_apply(ResNet18(num_classes=10, stem="cifar", bn_momentum=momentum))
    shifted = jax.tree.map(lambda s: s + 1.0, variables["batch_stats"])
    _, a = apply(variables, x)
    _, b = apply({**variables, "batch_stats": shifted}, x)
    same = all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same == forgets


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_a_resnet_state_carries_batch_statistics_that_train_steps_update_and_eval_reads(
    cifar_state):
  x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype(np.float32)
  y = np.arange(4, dtype=np.int32)
  state = cifar_state
  assert state.takes_train and state.batch_stats is not None
  trained, sums = train_step(state, x, y)
  assert int(sums["count"]) == 4 and int(trained.step) == 1
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), state.batch_stats,
                       trained.batch_stats)
  assert all(jax.tree.leaves(moved))  # every running statistic took the batch in
  # Evaluation normalises with the running statistics: other statistics, other loss.
  mask = np.ones(4, bool)
  shifted = trained.replace(batch_stats=jax.tree.map(lambda s: s + 1.0, trained.batch_stats))
  assert float(eval_step(trained, x, y, mask)["loss_sum"]) != float(
      eval_step(shifted, x, y, mask)["loss_sum"])


def test_a_model_without_batch_statistics_gets_none_and_is_called_without_train():
  state = create_train_state(SmallCNN(), optax.sgd(0.1), jnp.zeros((1, 8, 8, 1)),
                             jax.random.key(0, impl="rbg"))  # (rbg: cheaper to compile)
  assert state.batch_stats is None and not state.takes_train
  state, _ = train_step(state, jnp.zeros((2, 8, 8, 1)), jnp.zeros(2, jnp.int32))
  assert state.batch_stats is None
