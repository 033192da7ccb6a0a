"""In-step collectives are ordered by data on every platform: lowered for CPU and for CUDA
(JAX lowers for ``cuda`` without a GPU), each MPI call depends on the previous one's result.

The communicator is this process's with ``size`` raised to 2, so collectives are traced (a
size-1 communicator traces none); nothing is executed.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mnjax
from lab.bench.hlo_order import dependencies, depends_on, mpi_calls, unchained, unchained_compiled
from mnjax.comm._instep import _allreduce as collectives
from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep import _primitives as mpi_ops
from mnjax.comm._instep import _sequence as sequence

LEAVES = {f"w{i}": jnp.ones((64 + i,), jnp.float32) for i in range(6)}


@pytest.fixture(scope="module")
def two_ranks(comm):
  return dataclasses.replace(comm, size=2)


def lowered(fn, *args, platform):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("wire_dtype", [None, jnp.bfloat16])
def test_buckets_are_chained_by_data(two_ranks, platform, wire_dtype):
  fn = lambda t: collectives.allreduce_tree(t, two_ranks, wire_dtype=wire_dtype, bucket_bytes=600)
  text = lowered(fn, LEAVES, platform=platform)
  calls = mpi_calls(text)
  buckets = bucketing.plan_buckets(
      list(LEAVES.values()), wire_dtype=wire_dtype and np.dtype(wire_dtype), bucket_bytes=600)
  assert len(buckets) >= 2
  # A 16-bit wire is an alltoall and an allgather per bucket.
  assert len(calls) == len(buckets) * (1 if wire_dtype is None else 2), calls
  assert unchained(text) == []


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_checker_sees_independent_collectives(comm, platform):
  """Mutation check of the test itself: two collectives without `after` are reported."""
  fn = lambda a, b: (mpi_ops.allreduce_sum(a, comm.device_comm),
                     mpi_ops.allreduce_sum(b, comm.device_comm))
  text = lowered(fn, jnp.ones(4), jnp.ones(4), platform=platform)
  assert len(mpi_calls(text)) == 2 and len(unchained(text)) == 1


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_checker_follows_calls_into_branches(comm, platform):
  """Collectives inside lax.cond branches (as the multi-device kinds issue them): two
  independent ones are reported, chained ones are not."""
  def in_branch(x, after=None):
    return jax.lax.cond(x[0] > 0, lambda v: mpi_ops.allreduce_sum(v, comm.device_comm, after),
                        lambda v: v, x)

  independent = lambda a, b: (in_branch(a), in_branch(b))
  chained = lambda a, b: in_branch(b, after=in_branch(a))
  assert len(unchained(lowered(independent, jnp.ones(4), jnp.ones(4), platform=platform))) == 1
  assert unchained(lowered(chained, jnp.ones(4), jnp.ones(4), platform=platform)) == []


def test_the_compiled_checker_sees_independent_collectives_and_chained_ones(comm):
  independent = lambda a, b: (mpi_ops.allreduce_sum(a, comm.device_comm),
                              mpi_ops.allreduce_sum(b, comm.device_comm))
  chained = lambda a, b: mpi_ops.allreduce_sum(
      b, comm.device_comm, after=mpi_ops.allreduce_sum(a, comm.device_comm))
  compiled = lambda f: jax.jit(f).lower(jnp.ones(4), jnp.ones(4)).compile().as_text()
  assert len(unchained_compiled(compiled(independent))) == 1
  assert unchained_compiled(compiled(chained)) == []


def test_gpu_lowering_ties_the_operand_to_after(comm):
  fn = lambda a, b: mpi_ops.allreduce_sum(b, comm.device_comm,
                                          after=mpi_ops.allreduce_sum(a, comm.device_comm))
  text = lowered(fn, jnp.ones(4), jnp.ones(4), platform="cuda")
  assert [t for _, t in mpi_calls(text)] == ["mpi_allreduce_ffi"] * 2
  assert unchained(text) == []


def test_the_tie_survives_compilation_and_changes_no_value():
  """XLA's simplifier keeps ``s * 0`` for floats, so the compiled tie still reads `after`
  (an optimization_barrier's unread operand would be dropped); values, NaN in `after` and
  the sign of zero are untouched."""
  text = jax.jit(mpi_ops._tie).lower(jnp.ones(4), jnp.ones(3)).compile().as_text()
  entry = text[text.index("ENTRY"):]
  after = re.search(r"%([\w.]+) = f32\[3\]\{0\} parameter\(1\)", entry).group(1)
  assert re.search(rf"ROOT .*\(.*%{re.escape(after)}\b", entry), entry
  x = jnp.array([-0.0, 1.5, -2.0, np.inf])
  for a in (jnp.array([np.nan]), jnp.array([-np.inf]), jnp.array([-3.0]), jnp.zeros((), jnp.uint8)):
    out = np.asarray(mpi_ops._tie(x, a))
    np.testing.assert_array_equal(out, np.asarray(x))
    assert np.signbit(out[0])


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_a_train_step_is_one_chain(two_ranks, platform):
  """SyncBatchNorm's collectives and the gradient buckets of a whole step."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(16)(x)
      x = mnjax.SyncBatchNorm(two_ranks, use_running_average=False)(x)
      return nn.Dense(4)(nn.relu(x))

  net = Net()
  variables = net.init(jax.random.key(0), jnp.ones((8, 8)))
  # What allreduce_gradients does after its pre-flight check (which needs real ranks:
  # tests/distributed/test_devices_placement.py compiles the full step under mpirun).
  reduce = lambda g: collectives.allreduce_tree(g, two_ranks, bucket_bytes=256)

  def step(params, stats, x):
    def loss(p):
      y, new = net.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
      return jnp.mean(y ** 2), new
    grads, _ = jax.grad(loss, has_aux=True)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, reduce(grads))

  with sequence.recording():  # as data_parallel traces it (SyncBatchNorm needs the check)
    text = lowered(step, variables["params"], variables["batch_stats"], jnp.ones((8, 8)),
                   platform=platform)
  assert len(mpi_calls(text)) >= 4  # BN forward and backward, and the gradient buckets
  assert unchained(text) == []


def _returned(text: str) -> list[str]:
  """The values the lowered main function returns, in order."""
  main = text[text.index("func.func public @main"):]
  line = next(ln for ln in main.splitlines() if ln.strip().startswith("return "))
  return [name.split("#")[0] for name in re.findall(r"%([\w.\-#]+)", line.split(":")[0])]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("early", [True, False], ids=["gpu_timing", "cpu_timing"])
def test_the_first_bucket_leaves_before_the_first_layers_gradient(two_ranks, platform, norm,
                                                                  early, monkeypatch):
  """Buckets go in backprop order (the output layer's first). On GPUs (`leaves_early`) the
  first one waits for its own leaves and the collective before it (SyncBatchNorm's last
  backward one), not for every gradient: the first layer's gradient is still being
  computed while it travels. On CPUs it waits for every leaf, unless SyncBatchNorm's chain
  already orders it (then it follows that layer's last backward collective everywhere)."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(16)(x))
      if norm:
        x = mnjax.SyncBatchNorm(two_ranks, use_running_average=False)(x)
      return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

  net = Net()
  variables = net.init(jax.random.key(0), jnp.ones((8, 8)))

  def first_call_waits_for_the_first_layer():
    def step(variables, x):  # a new function each time: not a cached trace
      def loss(p):
        y, _ = net.apply(dict(variables, params=p), x, mutable=["batch_stats"])
        return jnp.mean(y ** 2)
      grads = jax.grad(loss)(variables["params"])
      reduced = collectives.allreduce_tree(grads, two_ranks, bucket_bytes=256)
      return reduced, grads["Dense_0"]["kernel"]  # the last gradient backprop finishes

    with sequence.recording(), collectives.buckets_leave_early(early):
      text = lowered(step, variables, jnp.ones((8, 8)), platform=platform)
    calls = mpi_calls(text)
    assert len(calls) >= 2 * norm + 3, calls  # SyncBatchNorm's two, then the buckets
    gradient = _returned(text)[-1]
    first_bucket = calls[2 * norm][0]  # after SyncBatchNorm's forward and backward ones
    return depends_on(dependencies(text), first_bucket, gradient)

  assert first_call_waits_for_the_first_layer() == (not early and not norm)
  # Mutation check of the test: the barrier (wait for every leaf) is seen where it is used.
  monkeypatch.setattr(sequence.ORDER, "last", lambda: None)
  monkeypatch.setattr(sequence, "noted", lambda prefix: True)
  assert first_call_waits_for_the_first_layer()


def test_buckets_leave_in_backprop_order_with_layer_numbers_read_as_numbers():
  tree = {name: {"kernel": jnp.ones(64)} for name in
          ("BatchNorm_0", "Conv_0", "Conv_1", "Conv_2", "Conv_10", "Dense_0")}
  order, buckets = bucketing.tree_buckets(tree, bucket_bytes=256)
  paths = list(jax.tree_util.tree_flatten_with_path(tree)[0])
  first_out = [jax.tree_util.keystr(paths[order[b.positions[0]]][0]) for b in buckets]
  assert first_out == [f"['{n}']['kernel']" for n in
                       ("Dense_0", "Conv_10", "Conv_2", "Conv_1", "Conv_0", "BatchNorm_0")]
