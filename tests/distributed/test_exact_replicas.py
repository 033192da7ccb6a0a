"""create_communicator(..., replicas=V): the gradient sum, shard_optimizer's updates, the
metrics' sums and the loop checkpoints' partial sums have the same bits on every layout of V
replicas over processes and local devices, under every kind that supports it, and bad
replica counts are refused on every rank.

Runs as one process and under mpirun -n 2 and -n 3 (tests/jobs/test_mpirun.py), two CPU
devices per process: V = 2 x size for the multi-device kinds, V = size for ``flat``. The
reference is `exact_sum` of the same V replicas in one program; replica r's gradient is a
fixed function of r. The end-to-end proof, a training job at 1 to 6 processes, is
tests/jobs/test_replicas.py.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import mnjax
from mnjax.comm._instep import _exact as exact
from mnjax.comm._instep._allreduce import sum_buffer

KINDS = ["flat", "hierarchical", "two_dimensional", "single_node"]
multi_rank = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                                reason="ranks that disagree need two ranks (runs under mpirun)")


def gradient(r):
  """Replica r's gradient: two leaves over many magnitudes."""
  rng = np.random.default_rng(100 + r)
  scale = np.exp(rng.uniform(-20, 6, 300)).astype(np.float32)
  return {"a": (rng.standard_normal(300) * scale).astype(np.float32).reshape(20, 15),
          "b": rng.standard_normal(7).astype(np.float32)}


def reference(count, mean):
  """The exact sum (or mean) of `count` replicas in one program (one replica: itself)."""
  if count == 1:
    return gradient(0)
  stacked = jax.tree.map(lambda *g: jnp.stack(g), *[gradient(r) for r in range(count)])

  def one(g):
    flat = jnp.concatenate([jnp.ravel(g["a"]), g["b"]])
    total = exact.exact_sum(flat, count, lambda y, after: jax.lax.psum(y, "r"), None)
    total = total / count if mean else total
    return {"a": total[:300].reshape(20, 15), "b": total[300:]}

  return jax.tree.map(lambda x: np.asarray(x[0]), jax.jit(jax.vmap(one, axis_name="r"))(
      stacked))


@pytest.mark.parametrize("kind, mean", [(k, False) for k in KINDS] + [("hierarchical", True)],
                         ids=[*KINDS, "hierarchical-mean"])
def test_the_sum_has_the_reference_bits_on_any_layout(comm, kind, mean):
  per = 1 if kind == "flat" else 2
  replicas = comm.size * per
  ec = mnjax.create_communicator(kind, replicas=replicas)
  assert ec.exact and ec.num_replicas == replicas and ec.local_device_count == per
  mine = [gradient(r) for r in range(comm.rank * per, (comm.rank + 1) * per)]
  stacked = jax.tree.map(lambda *g: np.stack(g), *mine)

  def step(g):
    g = jax.tree.map(lambda x: x[0], g)  # this device's replica
    return mnjax.comm.allreduce_tree(g, ec, mean=mean, bucket_bytes=None)

  got = mnjax.data_parallel(step, ec, batch_argnums=(0,))(stacked)
  want = reference(replicas, mean)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)
  # And within the stated error of the float64 sum.
  exact64 = jax.tree.map(lambda *g: np.sum(np.stack(g).astype(np.float64), 0) / (
      replicas if mean else 1), *[gradient(r) for r in range(replicas)])
  largest = max(float(np.abs(v).max()) for r in range(replicas)
                for v in jax.tree.leaves(gradient(r)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(exact64), strict=True):
    bound = exact.error_bound(largest, replicas) + 2.0 ** -22 * np.abs(w)
    assert np.all(np.abs(np.asarray(g, np.float64) - w) <= bound)


@pytest.mark.parametrize("kind", KINDS)
def test_sync_batch_norm_sums_have_the_reference_bits_on_any_layout(comm, kind):
  """`sum_buffer`, SyncBatchNorm's only path across replicas (statistics forward, their
  gradients backward), on an exact communicator: one program's exact sum, bit for bit."""
  per = 1 if kind == "flat" else 2
  ec = mnjax.create_communicator(kind, replicas=comm.size * per)
  mine = [gradient(r) for r in range(comm.rank * per, (comm.rank + 1) * per)]
  flat = np.stack([np.concatenate([g["a"].ravel(), g["b"]]) for g in mine])
  got = mnjax.data_parallel(lambda x: sum_buffer(x[0], ec), ec, batch_argnums=(0,))(flat)
  want = reference(ec.num_replicas, False)
  np.testing.assert_array_equal(np.asarray(got), np.concatenate([want["a"].ravel(), want["b"]]))


def test_a_step_on_an_exact_communicator_trains_the_same_on_every_rank(comm):
  """allreduce_gradients + adam under data_parallel: replicas identical on every rank."""
  ec = mnjax.create_communicator("hierarchical", replicas=2 * comm.size)
  tx = optax.chain(mnjax.allreduce_gradients(ec), optax.adam(1e-2))
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
  x = np.random.default_rng(comm.rank).standard_normal((4, 4)).astype(np.float32)

  def step(p, s, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  run = mnjax.data_parallel(step, ec, batch_argnums=(2,))
  state = tx.init(params)
  for _ in range(3):
    params, state = run(params, state, x)
  mnjax.check_replicas(params, ec)


def train_sharded(ec, tx):
  """3 steps of `tx` on a small model over `ec`'s replicas, replica r on its own 2 examples."""
  params = {"w": jnp.linspace(-1.0, 1.0, 35).reshape(7, 5), "b": jnp.zeros(3)}
  per = ec.local_device_count
  x = np.concatenate([np.random.default_rng(400 + r).standard_normal((2, 7)).astype(np.float32)
                      for r in range(ec.rank * per, (ec.rank + 1) * per)])

  def step(p, s, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  run, s = mnjax.data_parallel(step, ec, batch_argnums=(2,)), tx.init(params)
  for _ in range(3):
    params, s = run(params, s, x)
  return jax.tree.map(np.asarray, params)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_shard_optimizer_on_an_exact_communicator_trains_as_the_chain(comm, kind):
  """shard_optimizer(adam) over the processes of an exact communicator (one device each, or
  two: the multi-device kinds gather alike, on local device 0): replicas identical on every
  rank, and the parameters of chain(allreduce_gradients, adam) to float32 rounding (the
  update is computed on shares, then gathered, then applied)."""
  ec = mnjax.create_communicator(kind, replicas=(1 if kind == "flat" else 2) * comm.size)
  sharded = train_sharded(ec, mnjax.shard_optimizer(optax.adam(1e-2), ec))
  mnjax.check_replicas(sharded, ec)
  chain = train_sharded(ec, optax.chain(mnjax.allreduce_gradients(ec), optax.adam(1e-2)))
  for name in chain:
    np.testing.assert_allclose(sharded[name], chain[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 2,
                    reason="2 replicas as P processes x 2 / P devices: 1 or 2 processes")
@pytest.mark.parametrize("clip", [None, 0.05], ids=["adam", "clipped"])
def test_shard_optimizer_gives_the_same_bits_on_another_layout(comm, clip):
  """Two replicas as this job's processes (the state in halves under mpirun -n 2) and as one
  process with 2 devices (MPI.COMM_SELF: one share): shard_optimizer(adam), also with its
  global-norm clip, ends with the same parameters, bit for bit."""
  spread = mnjax.create_communicator("hierarchical", replicas=2)
  alone = mnjax.create_communicator("hierarchical", MPI.COMM_SELF, replicas=2)
  a, b = (train_sharded(ec, mnjax.shard_optimizer(optax.adam(1e-2), ec, clip_global_norm=clip))
          for ec in (spread, alone))
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


class Net(nn.Module):
  """Dense, batch norm, Dense: the norm layer's statistics cross the replicas."""
  norm: object

  @nn.compact
  def __call__(self, x):
    x = self.norm(use_running_average=False)(nn.Dense(6)(x))
    return nn.Dense(1)(jnp.tanh(x))


def train_sync_batch_norm(ec, replicas):
  """3 SGD steps of `Net` with SyncBatchNorm on `ec`; this process runs `replicas` (their
  indices), replica r on its own 4 examples -> (params, batch stats, each replica's output)."""
  model = Net(norm=functools.partial(mnjax.SyncBatchNorm, ec))
  x = np.concatenate([np.random.default_rng(300 + r).standard_normal((4, 5)).astype(np.float32)
                      for r in replicas])
  variables = model.init(jax.random.key(0), x[:4])
  tx = optax.chain(mnjax.allreduce_gradients(ec), optax.sgd(0.1))

  def step(params, stats, opt, x):
    def loss(p):
      y, new = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
      return jnp.mean((y - 1.0) ** 2), (y, new["batch_stats"])

    grads, (y, stats) = jax.grad(loss, has_aux=True)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), stats, opt, y

  run = mnjax.data_parallel(step, ec, batch_argnums=(3,), per_device_outputs=(3,))
  params, stats = variables["params"], variables["batch_stats"]
  opt = tx.init(params)
  for _ in range(3):
    params, stats, opt, y = run(params, stats, opt, x)
  return jax.tree.map(np.asarray, (params, stats)), np.asarray(y)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 2,
                    reason="2 replicas as P processes x 2 / P devices: 1 or 2 processes")
def test_sync_batch_norm_gives_the_same_bits_on_another_layout(comm):
  """Two replicas as this job's processes (1 device each under mpirun -n 2) and as one
  process with 2 devices (MPI.COMM_SELF): the same parameters, running statistics and
  outputs, bit for bit, end to end. (Two float32 values add to the same bits in either
  order: sums over more replicas are checked against one program's in the test above.)"""
  spread = mnjax.create_communicator("hierarchical", replicas=2)
  alone = mnjax.create_communicator("hierarchical", MPI.COMM_SELF, replicas=2)
  assert (spread.size, alone.size, alone.local_device_count) == (comm.size, 1, 2)
  mine = range(comm.rank * spread.local_device_count,
               (comm.rank + 1) * spread.local_device_count)
  (params, stats), y = train_sync_batch_norm(spread, mine)
  (params1, stats1), y1 = train_sync_batch_norm(alone, range(2))
  for a, b in zip(jax.tree.leaves((params, stats)), jax.tree.leaves((params1, stats1)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(y, y1[list(mine)])
  mnjax.check_replicas(params, spread)


def metric_row(r):
  """Replica r's metric sums: floats over many magnitudes (their sum depends on its order)."""
  rng = np.random.default_rng(700 + r)
  return {"loss_sum": np.float32(rng.standard_normal() * 10.0 ** rng.integers(-4, 5)),
          "correct": np.int32(r + 1), "per_class": rng.standard_normal(3).astype(np.float32)}


def rows_of(ec):
  """This process's rows (replicas rank * L .. rank * L + L - 1), stacked."""
  per = ec.local_device_count
  mine = [metric_row(r) for r in range(ec.rank * per, (ec.rank + 1) * per)]
  return jax.tree.map(lambda *x: np.stack(x), *mine)


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_per_replica_metrics_add_every_row_in_replica_order(comm, kind):
  """allreduce_metrics(per_replica=True) equals the V rows added one by one in float64 /
  int64, replica 0 first: a sum that does not depend on how the rows are spread."""
  ec = mnjax.create_communicator(kind, replicas=comm.size * (1 if kind == "flat" else 2))
  got = mnjax.allreduce_metrics(rows_of(ec), ec, per_replica=True)
  widened = [jax.tree.map(lambda x: x.astype(np.int64 if x.dtype.kind == "i" else np.float64),
                          metric_row(r)) for r in range(ec.num_replicas)]
  want = functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), widened)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert np.asarray(got[key]).dtype == want[key].dtype, key


def test_per_replica_metrics_without_a_row_per_replica_are_refused_on_every_rank(comm):
  ec = mnjax.create_communicator("hierarchical", replicas=2 * comm.size)
  with pytest.raises(ValueError, match=r"leaf \['count'\] has shape \(\), but per-replica"
                     r" values need a first axis of this process's 2 replica\(s\)"):
    mnjax.allreduce_metrics({"count": 4}, ec, per_replica=True)
  with pytest.raises(TypeError, match="per_replica must be a bool"):
    mnjax.allreduce_metrics({"count": 4}, ec, per_replica=1)


def test_loop_checkpoints_keep_every_replicas_row(comm, tmp_path):
  """Saved: all V rows (what a resume at another process count needs); restored: this
  process's rows, in the dtypes of the loop's zero sums."""
  ec = mnjax.create_communicator("hierarchical", replicas=2 * comm.size)
  state, rows = {"w": jnp.arange(3.0)}, rows_of(ec)
  zero = jax.tree.map(np.zeros_like, rows)
  with mnjax.checkpoint.LoopCheckpoints(tmp_path, ec, resume=False, per_replica=True) as loop:
    loop.start(state, zero)
    loop.save(5, state, rows, epoch=1, batch=5)
  with mnjax.checkpoint.LoopCheckpoints(tmp_path, ec, resume=True, per_replica=True) as loop:
    _, got, epoch, batch = loop.start(state, zero)
  assert (epoch, batch) == (1, 5)
  for key in rows:
    np.testing.assert_array_equal(got[key], rows[key], err_msg=key)
    assert got[key].dtype == rows[key].dtype, key


@pytest.mark.parametrize("replicas, match", [
    (0, "replicas must be a positive int"),
    (2.0, "replicas must be a positive int"),
])
def test_a_bad_replica_count_is_refused(comm, replicas, match):
  with pytest.raises(ValueError, match=match):
    mnjax.create_communicator("hierarchical", replicas=replicas)


def test_kinds_and_options_that_cannot_be_exact_are_refused(comm):
  with pytest.raises(ValueError, match="kind 'flat' runs one replica per process"):
    mnjax.create_communicator("flat", replicas=2 * comm.size)
  with pytest.raises(ValueError, match="not supported by kind 'xla'"):
    mnjax.create_communicator("xla", replicas=comm.size)
  ec = mnjax.create_communicator("hierarchical", replicas=2 * comm.size)
  with pytest.raises(ValueError, match="rounds each gradient to 16 bits"):
    mnjax.allreduce_gradients(ec, wire_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="rounds each gradient to 16 bits"):
    mnjax.shard_optimizer(optax.sgd(0.1), ec, wire_dtype=jnp.bfloat16)


@multi_rank
def test_a_count_the_processes_do_not_divide_is_refused_on_every_rank(comm):
  with pytest.raises(ValueError, match=f"does not divide over {comm.size} processes"):
    mnjax.create_communicator("hierarchical", replicas=2 * comm.size + 1)


@multi_rank
def test_different_counts_on_different_ranks_are_refused_on_every_rank(comm):
  with pytest.raises(ValueError, match="the ranks passed different replica counts"):
    mnjax.create_communicator("hierarchical", replicas=2 * comm.size * (1 + comm.rank % 2))
