"""accumulate_gradients: k micro-steps equal one step on a k-times larger global batch, and
micro-steps issue no collective (counted by mnjax's MPI handlers at run time)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _native as native

K, PER_RANK, DIM = 3, 4, 5


def loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def data(comm):
  """Every micro-batch of every rank; each rank uses its own slice."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((K, comm.size * PER_RANK, DIM)).astype(np.float32)
  y = rng.standard_normal((K, comm.size * PER_RANK)).astype(np.float32)
  return x, y


def make_step(tx):
  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def test_micro_steps_equal_one_large_batch_step_and_communicate_once(comm):
  params = {"w": jnp.ones(DIM), "b": jnp.zeros(())}
  tx = mnjax.accumulate_gradients(
      optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)), every_k=K)
  step, state = make_step(tx), tx.init(params)
  x, y = data(comm)
  mine = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
  calls = []
  for k in range(K):
    before = native.allreduce_calls()
    new, state = step(params, state, x[k, mine], y[k, mine])
    jax.block_until_ready(new)
    calls.append(native.allreduce_calls() - before)
    if k < K - 1:  # nothing applied, nothing exchanged yet
      assert all(np.array_equal(a, b)
                 for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)))
    params = new
  assert calls == [0] * (K - 1) + [0 if comm.size == 1 else 1]

  # One SGD step on the whole global batch of all K micro-steps, in one process.
  ref = {"w": jnp.ones(DIM), "b": jnp.zeros(())}
  grads = jax.grad(loss)(ref, x.reshape(-1, DIM), y.reshape(-1))
  ref = optax.apply_updates(ref, jax.tree.map(lambda g: -0.1 * g, grads))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(state.micro_step) == 0


def test_optax_multisteps_exchanges_on_every_micro_step(comm):
  # Why mnjax has its own: optax.MultiSteps runs the inner chain every micro-step and
  # masks the result, so the allreduce inside it runs K times per update.
  if comm.size == 1:
    pytest.skip("a size-1 communicator issues no collective at all (runs under mpirun)")
  params = {"w": jnp.ones(DIM), "b": jnp.zeros(())}
  tx = optax.MultiSteps(optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)), K)
  step, state = make_step(tx), tx.init(params)
  x, y = data(comm)
  before = native.allreduce_calls()
  for k in range(K):
    params, state = step(params, state, x[k, :PER_RANK], y[k, :PER_RANK])
  jax.block_until_ready(params)
  assert native.allreduce_calls() - before == K


def test_every_k_must_be_a_positive_int():
  inner = optax.sgd(0.1)
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="every_k must be an int >= 1"):
      mnjax.accumulate_gradients(inner, bad)


def test_a_checkpoint_inside_a_cycle_is_refused_with_several_replicas(comm, tmp_path):
  # Each replica's partial gradient sum is its own: saving rank 0's mid-cycle would lose the
  # others' micro-batches on resume. After a whole cycle the sum is empty: saved.
  tx = mnjax.accumulate_gradients(optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)),
                                  every_k=2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  checkpointer = mnjax.Checkpointer(tmp_path / "ckpt", comm)  # rank 0 writes in its own
  _, state = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
  if comm.num_replicas == 1:
    checkpointer.save(1, state)  # one replica: its sum is the whole sum
  else:
    with pytest.raises(ValueError, match=r"inside an accumulate_gradients cycle \(micro-step 1\)"
                                         r".*Nothing was saved"):
      checkpointer.save(1, state)
  _, state = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
  checkpointer.save(2, state)
  checkpointer.close()


def test_where_state_comes_back_from_the_first_device_only_it_is_refused(comm):
  # data_parallel traces the xla kind with several local devices inside this context
  # (tests/support/xla_worker.py checks the real case): each device's partial sum would be
  # replaced by device 0's between steps, a silently wrong gradient.
  from mnjax.comm._instep import _sequence as sequence

  tx = mnjax.accumulate_gradients(optax.sgd(0.1), every_k=2)
  params = {"w": jnp.ones(3)}
  with sequence.state_from_first_device(), pytest.raises(
      ValueError, match="keeps only the first device's copy"):
    jax.jit(tx.update)({"w": jnp.ones(3)}, tx.init(params), params)
  once = mnjax.accumulate_gradients(optax.sgd(0.1), every_k=1)  # nothing accumulates
  with sequence.state_from_first_device():
    jax.jit(once.update)({"w": jnp.ones(3)}, once.init(params), params)
