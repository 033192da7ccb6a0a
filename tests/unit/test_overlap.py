"""Overlap is possible by construction: in the compiled train step with double buffering, the
MPI collectives read only the optimizer state's pending gradient (entry parameters), never the
parameters or the batch, so nothing of the forward and backward pass precedes them by data.
Without double buffering the same check finds the dependency (the test can fail).

The communicator is this process's with ``size`` raised to 2, so collectives are traced (a
size-1 communicator traces none); the steps are compiled, never run. The ranks' pre-flight
checks (which need real ranks) are switched off.
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import mnjax
from lab.bench.hlo_order import (
  _computations,
  _functions,
  _statements,
  dependencies,
  depends_on,
  entry_units,
)
from mnjax.guard import _preflight as preflight
from mnjax.guard import _program as program

_PARAMETER = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[^=]*\sparameter\((\d+)\)")


@pytest.fixture(autouse=True)
def no_rank_checks(monkeypatch):
  monkeypatch.setattr(preflight, "check_same_on_all_ranks", lambda *a, **k: None)
  monkeypatch.setattr(preflight, "check_collective_sequence", lambda *a, **k: None)
  monkeypatch.setattr(program, "check_same_program", lambda *a, **k: None)


def two_ranks(kind):
  return dataclasses.replace(mnjax.create_communicator(kind), size=2)


def entry_parameters_read_by_collectives(text: str) -> set[int]:
  """The entry parameters (by number) that the MPI-issuing instructions depend on."""
  comps, entry = _computations(text)
  lines = comps[entry]
  numbers = {m.group(1): int(m.group(2)) for line in lines if (m := _PARAMETER.match(line))}
  deps = dependencies("\n".join(lines))
  units = entry_units(text)
  assert units, "no MPI collective in the compiled step"
  used = set()
  for unit in units:
    seen, todo = set(), [unit]
    while todo:
      for u in deps.get(todo.pop(), ()):
        if u not in seen:
          seen.add(u)
          todo.append(u)
    used |= {numbers[name] for name in seen if name in numbers}
  return used


class MLP(nn.Module):
  sync_bn: mnjax.Communicator | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    if self.sync_bn is not None:
      x = mnjax.SyncBatchNorm(self.sync_bn, use_running_average=False)(x)
    return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


def compiled_step(kc, tx, model):
  """The compiled text of a data-parallel train step ``(params, stats, opt_state, x)``, and
  the entry parameter numbers of the pending gradient's leaves."""
  x = jnp.ones((8 * kc.local_device_count, 16))
  variables = model.init(jax.random.key(0), x[:8])
  params, stats = variables["params"], variables.get("batch_stats", {})
  opt_state = tx.init(params)

  def step(params, stats, opt_state, x):
    def objective(p):
      out, new = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
      return jnp.mean(out ** 2), new.get("batch_stats", {})
    grads, stats = jax.grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state

  if kc.multi_device:  # what data_parallel runs: the step mapped over the local devices
    axis = P(kc.axis_name)
    run = jax.jit(jax.shard_map(step, mesh=kc.mesh, in_specs=(P(), P(), P(), axis),
                                out_specs=P(), check_vma=False))
  else:  # jax.jit plus the recording SyncBatchNorm needs
    run = mnjax.data_parallel(step, kc, batch_argnums=(3,))
  text = run.lower(params, stats, opt_state, x).compile().as_text()
  before = len(jax.tree.leaves((params, stats)))
  pending = len(jax.tree.leaves(opt_state.exchange.pending)) if isinstance(
      opt_state, mnjax.optim.DoubleBufferingState) else 0
  return text, set(range(before, before + pending)), len(jax.tree.leaves((params, stats,
                                                                          opt_state, x)))


KINDS = ["flat", "two_dimensional"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("wire_dtype", "bucket_bytes"), [(None, None), (jnp.bfloat16, 4096)])
def test_double_buffered_collectives_read_only_the_pending_gradient(kind, wire_dtype,
                                                                   bucket_bytes):
  kc = two_ranks(kind)
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1, momentum=0.9), kc,
                                         double_buffering=True, wire_dtype=wire_dtype,
                                         bucket_bytes=bucket_bytes)
  text, pending, _ = compiled_step(kc, tx, MLP())
  used = entry_parameters_read_by_collectives(text)
  assert used and used <= pending, (used, pending)


@pytest.mark.parametrize("kind", KINDS)
def test_without_double_buffering_the_collectives_wait_for_the_backward_pass(kind):
  """The check can fail: the plain exchange reads the gradients, so the parameters and the
  batch (entry parameters other than the optimizer state) precede it by data."""
  kc = two_ranks(kind)
  tx = optax.chain(mnjax.allreduce_gradients(kc), optax.sgd(0.1, momentum=0.9))
  text, _, count = compiled_step(kc, tx, MLP())
  used = entry_parameters_read_by_collectives(text)
  assert count - 1 in used  # the batch


@pytest.mark.parametrize("double_buffering", [True, False])
def test_lowered_for_cuda_the_collectives_read_the_same_inputs(double_buffering):
  """The same property in the step lowered for GPUs (StableHLO; JAX lowers for ``cuda``
  without a GPU): the MPI calls of ``main`` read only the pending gradient's arguments."""
  kc = two_ranks("flat")
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1, momentum=0.9), kc,
                                         double_buffering=double_buffering, bucket_bytes=4096)
  model = MLP()
  x = jnp.ones((8, 16))
  params = model.init(jax.random.key(0), x)["params"]
  opt_state = tx.init(params)

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  text = jax.jit(step).trace(params, opt_state, x).lower(lowering_platforms=("cuda",)).as_text()
  statements = _statements(_functions(text)["main"])
  deps = {name: uses for name, uses, _ in statements}
  calls = [name for name, _, body in statements if "mpi_allreduce" in body]
  assert calls
  used = set()
  for call in calls:
    seen, todo = set(), [call]
    while todo:
      for u in deps.get(todo.pop(), ()):
        if u not in seen:
          seen.add(u)
          todo.append(u)
    used |= {int(u[3:]) for u in seen if re.fullmatch(r"arg\d+", u)}
  n = len(jax.tree.leaves(params))
  pending = set(range(n, 2 * n))
  batch = len(jax.tree.leaves((params, opt_state)))
  if double_buffering:
    assert used and used <= pending, (used, pending)
  else:
    assert batch in used


def test_with_sync_batch_norm_the_exchange_waits_for_its_collectives():
  """SyncBatchNorm's MPI collectives and the exchange must keep one order on every rank, so
  there the double-buffered exchange is ordered after the new gradient (no overlap)."""
  kc = two_ranks("flat")
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1), kc, double_buffering=True)
  text, pending, count = compiled_step(kc, tx, MLP(sync_bn=kc))
  units = entry_units(text)
  comps, entry = _computations(text)
  deps = dependencies("\n".join(comps[entry]))
  # Every collective after the first depends on the one before: one chain, whatever order.
  assert all(depends_on(deps, b, a) for a, b in zip(units, units[1:])), units
  assert count - 1 in entry_parameters_read_by_collectives(text)


def test_the_cost_model_uses_the_implementations_bucket_plan():
  from lab.costmodel import hardware, step
  from mnjax.comm._instep._buckets import plan_buckets

  leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(64, 64), (64,), (4096,), (10,)]]
  sizes = step.planned_buckets(leaves, 8192)
  assert len(sizes) == len(plan_buckets(leaves, bucket_bytes=8192)) > 1
  assert sum(sizes) == 4 * sum(leaf.size for leaf in leaves)
  assert step.planned_buckets(leaves, 8192, wire_dtype=jnp.bfloat16) == [s / 2 for s in sizes]
  w = step.RESNET50.replace(params=sum(leaf.size for leaf in leaves), compute=1e-4)
  c = hardware.cluster("h200_ndr", gpus=16)
  plain = step.step_time(w, c, "flat", bucket_sizes=sizes)
  double = step.step_time(w, c, "flat", bucket_sizes=sizes, overlap="double_buffering",
                          interference=0.25)
  assert plain.comm == double.comm > 0
  want = max(w.compute + 0.25 * min(plain.comm, w.compute), plain.comm)
  assert double.total == pytest.approx(want) and double.total < plain.total
