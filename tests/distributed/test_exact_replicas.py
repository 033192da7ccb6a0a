"""create_communicator(..., replicas=V): the gradient sum has the same bits on every layout
of V replicas over processes and local devices, under every kind that supports it, and bad
replica counts are refused on every rank.

Runs as one process and under mpirun -n 2 and -n 3 (tests/jobs/test_mpirun.py), two CPU
devices per process: V = 2 x size for the multi-device kinds, V = size for ``flat``. The
reference is `exact_sum` of the same V replicas in one program; replica r's gradient is a
fixed function of r. The end-to-end proof, a training job at 1 to 6 processes, is
tests/jobs/test_replicas.py.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import mnjax
from mnjax.comm._instep import _exact as exact

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
  with pytest.raises(ValueError, match="SyncBatchNorm: its statistics are float sums"):
    mnjax.SyncBatchNorm(ec, use_running_average=False).init(jax.random.key(0), jnp.ones((2, 3)))
  assert isinstance(nn.BatchNorm, type)  # the suggested replacement exists
  flat = mnjax.create_communicator("flat", replicas=comm.size)
  with pytest.raises(ValueError, match="its reduce-scatter sums in floating point"):
    mnjax.shard_optimizer(optax.sgd(0.1), flat)


@multi_rank
def test_a_count_the_processes_do_not_divide_is_refused_on_every_rank(comm):
  with pytest.raises(ValueError, match=f"does not divide over {comm.size} processes"):
    mnjax.create_communicator("hierarchical", replicas=2 * comm.size + 1)


@multi_rank
def test_different_counts_on_different_ranks_are_refused_on_every_rank(comm):
  with pytest.raises(ValueError, match="the ranks passed different replica counts"):
    mnjax.create_communicator("hierarchical", replicas=2 * comm.size * (1 + comm.rank % 2))
