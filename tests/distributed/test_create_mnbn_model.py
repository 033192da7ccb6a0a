"""create_mnbn_model: an existing model's nn.BatchNorm layers run as SyncBatchNorm.

ChainerMN's test (links_tests/test_create_mnbn_model.py) checks that the converted model's
BatchNorm links are MultiNodeBatchNormalization and that it runs; here the conversion is
pinned by what it computes: the same variable tree and values as the original, the same
outputs, statistics and gradients as the model written with SyncBatchNorm, and those of the
original model on the global batch (on one rank: the original itself).
"""

import functools
import inspect

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lab.models
import lab.runner
import mnjax
from lab.models._resnet import BasicBlock
from mnjax.comm._host._broadcast import allreduce

PER_RANK = 3


def resnet(norm=nn.BatchNorm):
  """Stem, one identity block, one projection block (parallel branches: ordered collectives)."""
  return lab.models.ResNet(stage_sizes=(1, 1), block=BasicBlock, num_classes=3, stem="cifar",
                             norm=norm, zero_init_residual=False)


def inline(norm=nn.BatchNorm):
  """A user's model with its norms written inline (no norm field): one shared, one named."""

  class Inline(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = nn.Dense(4)(x.reshape(x.shape[0], -1))
      shared = norm(use_running_average=not train, momentum=0.8)
      y = nn.relu(shared(x))
      side = norm(use_running_average=not train, name="side")(nn.Dense(4)(x))
      return nn.Dense(3)(shared(y) + side)

  return Inline()


MODELS = {"resnet": resnet, "inline": inline}


def global_batch(size):
  return np.random.default_rng(0).normal(1.0, 2.0, (size * PER_RANK, 4, 4, 3)).astype(np.float32)


def shapes(model, x):
  """The variables' tree, shapes and dtypes (traced, not computed: a ResNet init is slow)."""
  return jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))


def variables_like(tree):
  """Fixed values for the variables of `tree` (positive variances)."""
  rng = np.random.default_rng(1)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: (np.ones(s.shape, s.dtype) if "'var'" in jax.tree_util.keystr(path)
                       else (0.3 * rng.normal(size=s.shape)).astype(s.dtype)), tree)


def mine(comm, array):
  return array[comm.rank * PER_RANK:(comm.rank + 1) * PER_RANK]


def loss_fn(model, params, stats, x):
  out, new = model.apply({"params": params, "batch_stats": stats}, x, train=True,
                         mutable=["batch_stats"])
  # not a plain sum; per example, so the global batch's loss is the sum of the ranks' losses
  weights = jnp.cos(x.sum(axis=(1, 2, 3)))[:, None] * jnp.linspace(-1.0, 2.0, out.shape[-1])
  return (out * weights).sum(), (out, new["batch_stats"])


def grad_step(model, comm):
  grad = jax.grad(functools.partial(loss_fn, model), has_aux=True)
  return mnjax.data_parallel(grad, comm, batch_argnums=(2,))


@pytest.mark.parametrize("name", MODELS)
def test_the_converted_model_keeps_its_class_fields_and_variables(comm, name):
  original = MODELS[name]()
  converted = mnjax.nn.create_mnbn_model(original, comm)
  assert isinstance(converted, type(original)) and type(converted).__name__ == type(
      original).__name__
  x = jnp.asarray(global_batch(1))
  ref, got = shapes(original, x), shapes(converted, x)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  assert jax.tree.leaves(jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype),
                                      got, ref)) == [True] * len(jax.tree.leaves(ref))
  # a checkpoint of the original restores into the converted model
  saved = variables_like(ref)
  restored = flax.serialization.from_bytes(variables_like(got),
                                           flax.serialization.to_bytes(saved))
  jax.tree.map(np.testing.assert_array_equal, restored, saved)
  # the same call signature: create_train_state passes train=False to init, train=True to steps
  assert inspect.signature(converted.__call__) == inspect.signature(original.__call__)
  if name == "inline":  # its eager init is quick: the same initial values too
    state = lab.runner.create_train_state(converted, optax.sgd(0.1), x, jax.random.key(0))
    assert state.takes_train
    want = original.init(jax.random.key(0), x, train=False)
    jax.tree.map(np.testing.assert_array_equal, {"params": state.params,
                                                 "batch_stats": state.batch_stats}, want)
  assert mnjax.nn.create_mnbn_model(original, comm) == converted  # one class: jit caches hit


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_outputs_and_gradients_equal_syncbatchnorm_and_the_global_batch(comm, name):
  make = MODELS[name]
  original, direct = make(), make(functools.partial(mnjax.SyncBatchNorm, comm))
  converted = mnjax.nn.create_mnbn_model(original, comm)
  full = global_batch(comm.size)
  x = jnp.asarray(mine(comm, full))
  variables = variables_like(shapes(original, x))
  args = (variables["params"], variables["batch_stats"], x)

  grads, (out, stats) = grad_step(converted, comm)(*args)
  d_grads, (d_out, d_stats) = grad_step(direct, comm)(*args)
  for got, want in ((out, d_out), (stats, d_stats), (grads, d_grads)):
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6), got, want)

  # The original on the global batch, in one process: on one rank, simply the original.
  r_grads, (r_out, r_stats) = jax.jit(jax.grad(functools.partial(loss_fn, original),
                                               has_aux=True))(*args[:2], jnp.asarray(full))
  np.testing.assert_allclose(out, mine(comm, np.asarray(r_out)), rtol=1e-5, atol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
               stats, r_stats)
  summed = allreduce(grads, comm)  # each rank's share of the global loss's gradient
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4),
               summed, r_grads)


def test_bad_input_is_named(comm):
  with pytest.raises(TypeError, match="expected a flax linen Module"):
    mnjax.nn.create_mnbn_model(nn.BatchNorm, comm)
  with pytest.raises(TypeError, match="Communicator"):
    mnjax.nn.create_mnbn_model(resnet(), None)
  x = jnp.zeros((2, 3))
  bound = nn.Dense(2).bind(nn.Dense(2).init(jax.random.key(0), x))
  with pytest.raises(ValueError, match="bound or is a submodule"):
    mnjax.nn.create_mnbn_model(bound, comm)
  grouped = mnjax.nn.create_mnbn_model(
      nn.BatchNorm(use_running_average=False, axis_index_groups=[[0]]), comm)
  with pytest.raises(ValueError, match="axis_index_groups"):
    grouped.init(jax.random.key(0), x)


def test_several_ranks_still_need_data_parallel(comm):
  if comm.size == 1:
    pytest.skip("one rank: SyncBatchNorm reduces locally, plain jax.jit is fine")
  converted = mnjax.nn.create_mnbn_model(inline(), comm)
  x = jnp.asarray(mine(comm, global_batch(comm.size)))
  variables = converted.init(jax.random.key(0), x, train=False)
  with pytest.raises(RuntimeError, match="outside mnjax.data_parallel"):
    jax.jit(functools.partial(loss_fn, converted))(variables["params"],
                                                   variables["batch_stats"], x)
