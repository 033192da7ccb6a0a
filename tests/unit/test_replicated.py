"""`varying_outputs`: which outputs of a per-device step may differ across the local devices.

One process, two emulated devices (tests/conftest.py). The steps are traced, never run: the
per-device program is the ``jaxpr`` parameter of the ``shard_map`` equation, as
`mnjax.data_parallel` maps it (``check_vma=False``). The MPI paths of the multi-device kinds
(``lax.cond``/``lax.switch`` on the axis index, mnjax's MPI custom calls) appear only with
several processes: `as_processes` gives a communicator that claims two for tracing only (the
eqn count of a traced ResNet-18 step matches a real 2-process trace under mpirun).
"""

import dataclasses
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import lab.models
import mnjax
from mnjax.guard import _preflight as preflight
from mnjax.guard import _program as program
from mnjax.train._replicated import varying_outputs

AXIS = "batch"
KINDS = ["hierarchical", "two_dimensional", "single_node"]


@pytest.fixture(scope="module")
def hierarchical():
  return mnjax.create_communicator("hierarchical")


def as_processes(comm, size, monkeypatch):
  """`comm` claiming `size` processes, for tracing only (its MPI calls are never run)."""
  if size == 1:
    return comm
  # allreduce_gradients' pre-flight and the wrappers' program check are host collectives
  # over ranks that do not exist here.
  monkeypatch.setattr(preflight, "check_same_on_all_ranks", lambda *a, **k: None)
  monkeypatch.setattr(program, "check_same_program", lambda *a, **k: None)
  return dataclasses.replace(comm, size=size)


def per_device(fn, comm, args, batch_argnums):
  """`fn`'s per-device jaxpr under shard_map, which of its inputs are batch leaves, and the
  paths of its output leaves."""
  specs = tuple(P(comm.axis_name) if i in batch_argnums else P() for i in range(len(args)))
  mapped = jax.shard_map(fn, mesh=comm.mesh, in_specs=specs, out_specs=P(), check_vma=False)
  with preflight.recording():  # as data_parallel: SyncBatchNorm's collectives are noted
    outer, shapes = jax.make_jaxpr(mapped, return_shape=True)(*args)
  (eqn,) = [e for e in outer.jaxpr.eqns if e.primitive.name == "shard_map"]
  varying = [i in batch_argnums for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
  return eqn.params["jaxpr"], varying, paths


def varying_paths(fn, comm, args, batch_argnums):
  """The paths of `fn`'s output leaves that may differ across devices."""
  jaxpr, varying, paths = per_device(fn, comm, args, batch_argnums)
  out = varying_outputs(jaxpr, varying, comm.axis_name)
  assert len(paths) == len(out)
  return [p for p, v in zip(paths, out) if v]


class Net(nn.Module):
  """A convolution, a SyncBatchNorm and a classifier."""

  comm: mnjax.Communicator

  @nn.compact
  def __call__(self, x):
    x = mnjax.SyncBatchNorm(self.comm, use_running_average=False)(nn.Conv(4, (3, 3))(x))
    return nn.Dense(3)(nn.relu(x).mean((1, 2)))


def train_step(comm, model, tx):
  def step(params, stats, opt_state, images, labels):
    def loss(p):
      logits, new = model.apply({"params": p, "batch_stats": stats}, images,
                                mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new
    (value, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = {"loss": value, "mean_loss": lax.pmean(value, comm.axis_name),
               "global_loss": mnjax.comm.allreduce_tree(value, comm)}
    return optax.apply_updates(params, updates), new["batch_stats"], opt_state, metrics
  return step


def step_args(model, tx):
  images, labels = jnp.ones((4, 5, 5, 2)), jnp.zeros(4, jnp.int32)
  variables = model.init(jax.random.key(0), images[:2])
  return (variables["params"], variables["batch_stats"], tx.init(variables["params"]),
          images, labels)


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_a_train_step_has_invariant_state_and_a_varying_per_device_loss(kind, processes,
                                                                        monkeypatch):
  comm = as_processes(mnjax.create_communicator(kind), processes, monkeypatch)
  model = Net(comm)
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1, momentum=0.9))
  args = step_args(model, tx)
  # Parameters (through allreduce_gradients), SyncBatchNorm statistics, momentum, the
  # pmean'd and the all-reduced loss: the same on every device. The raw loss: device's own.
  assert varying_paths(train_step(comm, model, tx), comm, args, (3, 4)) == ["[3]['loss']"]


def test_the_mpi_paths_of_the_multi_device_kinds_are_in_the_traced_program(monkeypatch):
  # What the test above covers with 2 processes: the cond/switch on the axis index that
  # lets a device call MPI, and the MPI custom call, between the local collectives.
  for kind, local in (("hierarchical", "psum"), ("two_dimensional", "reduce_scatter")):
    comm = as_processes(mnjax.create_communicator(kind), 2, monkeypatch)
    jaxpr, _, _ = per_device(lambda g, c=comm: mnjax.comm.allreduce_tree(g, c), comm,
                          (jnp.ones(3),), ())
    names = [e.primitive.name for e in jaxpr.eqns]
    assert {"axis_index", "cond", local} <= set(names), names
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    inner = {e.primitive.name for b in cond.params["branches"] for e in b.jaxpr.eqns}
    assert "mnjax_allreduce_sum" in inner
    assert varying_outputs(jaxpr, [True], comm.axis_name) == [False]


def test_a_step_traced_inside_shard_map_with_make_jaxpr(hierarchical):
  # The other way to get the per-device program (a ClosedJaxpr): make_jaxpr inside.
  seen = {}

  def inner(w, x):
    def step(w, x):
      return w - lax.pmean(x.mean(), AXIS), x.sum()
    seen["closed"] = jax.make_jaxpr(step)(w, x)
    return step(w, x)

  jax.make_jaxpr(jax.shard_map(inner, mesh=hierarchical.mesh, in_specs=(P(), P(AXIS)),
                               out_specs=P(), check_vma=False))(1.0, jnp.ones(4))
  assert varying_outputs(seen["closed"], [False, True], AXIS) == [False, True]


def analyse(fn, *args, varying):
  return varying_outputs(jax.make_jaxpr(fn, axis_env=[(AXIS, 2)])(*args), varying, AXIS)


def test_reductions_over_the_axis_are_invariant_and_the_batch_is_varying():
  def fn(w, x):
    return (lax.pmean(x, AXIS), lax.psum(x, AXIS), lax.pmax(x, AXIS), lax.pmin(x, AXIS),
            lax.all_gather(x, AXIS), lax.pbroadcast(x, (AXIS,), 0), x.mean(), x * w, w * 2.0,
            jnp.float32(3.0))
  assert analyse(fn, 1.0, jnp.ones(4), varying=[False, True]) == [
      False, False, False, False, False, False, True, True, False, False]


def test_the_axis_index_and_collectives_that_spread_values_are_varying():
  def fn(w):
    return (lax.axis_index(AXIS), lax.ppermute(w, AXIS, [(0, 1), (1, 0)]),
            lax.all_to_all(jnp.stack([w, w]), AXIS, 0, 0),
            lax.psum_scatter(jnp.stack([w, w]), AXIS),
            lax.psum(w, AXIS, axis_index_groups=[[0], [1]]), lax.psum(w, "other"))
  closed = jax.make_jaxpr(fn, axis_env=[(AXIS, 2), ("other", 1)])(1.0)
  # Invariant inputs: only a psum over another axis keeps the operand rule.
  assert varying_outputs(closed, [False], AXIS) == [True, True, True, True, True, False]


def test_cond_on_the_axis_index_is_varying_and_on_an_invariant_predicate_follows_branches():
  def fn(w, x):
    on_index = lax.cond(lax.axis_index(AXIS) == 0, lambda w: w, lambda w: w * 0.0, w)
    invariant = lax.cond(w > 0, lambda w: w + 1.0, lambda w: w - 1.0, w)
    one_branch = lax.cond(w > 0, lambda w, x: w, lambda w, x: x.sum(), w, x)
    switched = lax.switch(lax.axis_index(AXIS), [lambda w: w, lambda w: -w], w)
    return on_index, invariant, one_branch, switched
  assert analyse(fn, 1.0, jnp.ones(3), varying=[False, True]) == [True, False, True, True]


def test_scan_and_while_iterate_their_carry_to_a_fixed_point():
  def swap(carry, _):
    a, b, c = carry
    return (b, c, a), a  # a varying c reaches b, then a, only at later iterations

  def fn(w, x):
    scanned, ys = lax.scan(swap, (w, w, x), None, length=3)
    looped = lax.while_loop(lambda s: s[3] < 3, lambda s: (*swap(s[:3], None)[0], s[3] + 1),
                            (w, w, x, 0))
    steady = lax.scan(lambda c, _: (c * 2.0, c), w, None, length=3)
    return scanned, ys, looped, steady
  assert analyse(fn, 1.0, 2.0, varying=[False, True]) == [
      True, True, True, True, True, True, True, False, False, False]
  assert analyse(fn, 1.0, 2.0, varying=[False, False]) == [False] * 10


def test_a_while_whose_predicate_differs_across_devices_is_varying():
  def fn(w, x):
    # Each device stops after its own number of iterations: even a carry built from
    # invariant values ends differently.
    return lax.while_loop(lambda s: s[1] < x, lambda s: (s[0] * w, s[1] + 1.0), (w, 0.0))
  assert analyse(fn, 1.0, 3.0, varying=[False, True]) == [True, True]
  assert analyse(fn, 1.0, 3.0, varying=[False, False]) == [False, False]


def test_nested_programs_are_followed():
  @jax.custom_vjp
  def indexed(w):
    return w * lax.axis_index(AXIS)
  indexed.defvjp(lambda w: (indexed(w), None), lambda _, g: (g,))

  def fn(w, x):
    return (jax.checkpoint(lambda w: jnp.sin(w) * 2.0)(w),
            jax.checkpoint(lambda w: w + lax.axis_index(AXIS))(w),
            jax.jit(lambda w, x: (w * 2.0, x * 2.0))(w, x),
            jax.nn.relu(w), jax.nn.relu(x), indexed(w),
            jax.jit(lambda w: lax.pmean(w * x, AXIS))(w))
  assert analyse(fn, 1.0, 2.0, varying=[False, True]) == [
      False, True, False, True, False, True, True, False]


def test_gradients_through_custom_rules_and_an_io_callback():
  @jax.custom_vjp
  def scaled(w):
    return w * 2.0
  scaled.defvjp(lambda w: (w * 2.0, None), lambda _, g: (g * lax.axis_index(AXIS),))

  def fn(w):
    read = io_callback(lambda w: np.float32(w), jax.ShapeDtypeStruct((), jnp.float32), w)
    return jax.grad(jax.nn.relu)(w), jax.grad(scaled)(w), scaled(w), read
  # The backward rule reads the axis index; an io_callback may read anything per device.
  assert analyse(fn, 1.0, varying=[False]) == [False, True, False, True]


@pytest.mark.parametrize("kind", ["hierarchical", "two_dimensional"])
def test_per_device_optimizer_state_of_double_buffering_and_accumulation_is_varying(
    kind, monkeypatch):
  # By design these keep each device's own gradient in state declared replicated (its
  # shard stays on its device from step to step): what the analysis reports.
  comm = as_processes(mnjax.create_communicator(kind), 2, monkeypatch)
  model = Net(comm)
  double = mnjax.create_multi_node_optimizer(optax.sgd(0.1), comm, double_buffering=True)
  args = step_args(model, double)
  params = len(jax.tree.leaves(args[0]))
  found = varying_paths(train_step(comm, model, double), comm, args, (3, 4))
  assert found[-1] == "[3]['loss']" and len(found) == params + 1
  assert all(p.startswith("[2].exchange.pending[") for p in found[:-1]), found
  every = mnjax.optim.accumulate_gradients(
      optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)), 2)
  found = varying_paths(train_step(comm, model, every), comm, step_args(model, every), (3, 4))
  assert found[-1] == "[3]['loss']" and len(found) == params + 1
  assert all(".grad_sum[" in p for p in found[:-1]), found


def test_plain_batch_norm_statistics_are_varying(hierarchical):
  # The per-device statistics of flax's BatchNorm without axis_name: device 0's would be kept.
  model = nn.BatchNorm(use_running_average=False)
  x = jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)
  synced = nn.BatchNorm(use_running_average=False, axis_name=AXIS)

  def step(m):
    return lambda v, x: m.apply(v, x, mutable=["batch_stats"])[1]

  assert len(varying_paths(step(model), hierarchical, (variables, x), (1,))) == 2
  assert varying_paths(step(synced), hierarchical, (variables, x), (1,)) == []


def test_a_resnet18_step_is_analysed_in_a_fraction_of_its_trace(hierarchical):
  model = lab.models.ResNet18(num_classes=10, stem="cifar",
                                norm=functools.partial(mnjax.SyncBatchNorm, hierarchical))
  tx = optax.chain(mnjax.allreduce_gradients(hierarchical), optax.sgd(0.1, momentum=0.9))
  images, labels = jnp.ones((4, 16, 16, 3)), jnp.zeros(4, jnp.int32)
  variables = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0),
                             images[:2])

  def step(params, stats, opt_state, images, labels):
    def loss(p):
      logits, new = model.apply({"params": p, "batch_stats": stats}, images, train=True,
                                mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new
    (value, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new["batch_stats"], opt_state, value

  args = (variables["params"], variables["batch_stats"],
          jax.eval_shape(tx.init, variables["params"]), images, labels)
  start = time.perf_counter()
  jaxpr, varying, _ = per_device(step, hierarchical, args, (3, 4))
  traced = time.perf_counter() - start
  start = time.perf_counter()
  out = varying_outputs(jaxpr, varying, AXIS)
  analysed = time.perf_counter() - start
  assert out == [False] * (len(out) - 1) + [True]  # all state invariant, the loss varying
  assert len(jaxpr.eqns) > 2000
  assert analysed < max(1.0, traced), (analysed, traced)  # ~20 ms for ~3000 eqns here


def test_arguments_are_checked():
  closed = jax.make_jaxpr(lambda w, x: w * x)(1.0, 2.0)
  with pytest.raises(ValueError, match="2 inputs, but varying_inputs has 1"):
    varying_outputs(closed, [True], AXIS)
  with pytest.raises(TypeError, match="expected a ClosedJaxpr or Jaxpr"):
    varying_outputs(lambda w: w, [True], AXIS)
  with pytest.raises(TypeError, match="axis_name must be a str"):
    varying_outputs(closed, [True, False], ("batch",))
