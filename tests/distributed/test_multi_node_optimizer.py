"""`create_multi_node_optimizer(tx, comm)`: a port whose optimizer state IS `tx`'s state, so a
checkpoint of the original single-process (or pmap) script restores with its momentum and
schedule count, and training continues as the original's own resume; under mpirun it
averages exactly like ``optax.chain(allreduce_gradients(comm), tx)``."""

import flax.serialization as serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax

FEATURES = 5
PER_RANK = 4


def optimizers():
  """Inner optimizers whose state carries what a silent reset would lose."""
  return {
      "sgd_momentum_schedule": optax.sgd(optax.linear_schedule(0.1, 0.01, 20), momentum=0.9),
      "adamw": optax.adamw(optax.cosine_decay_schedule(1e-2, 50), weight_decay=1e-2),
      "clip_then_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  }


def init_params():
  return {"w": jnp.linspace(-1.0, 1.0, FEATURES), "b": jnp.zeros(())}


def loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def global_batch(step, replicas):
  """The global batch of `step`: PER_RANK examples per replica, the same on every rank."""
  rng = np.random.default_rng(step)
  x = rng.normal(size=(PER_RANK * replicas, FEATURES)).astype(np.float32)
  return x, (x @ np.arange(FEATURES, dtype=np.float32) + 0.5).astype(np.float32)


def make_step(tx):
  @jax.jit
  def step(params, opt_state, x, y):
    updates, opt_state = tx.update(jax.grad(loss)(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def test_state_is_the_inner_optimizers_state(comm):
  params = init_params()
  for name, tx in optimizers().items():
    wrapped = mnjax.create_multi_node_optimizer(tx, comm)
    assert jax.tree.structure(wrapped.init(params)) == jax.tree.structure(tx.init(params)), name
    # The whole tree alike: the same leaves, values and types (not only the structure).
    for a, b in zip(jax.tree.leaves(wrapped.init(params)), jax.tree.leaves(tx.init(params))):
      assert a.dtype == b.dtype and np.array_equal(a, b), name
  # The chain of README's step 2 does not keep it: that is what this path is for.
  chain = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1, momentum=0.9))
  assert (jax.tree.structure(chain.init(params))
          != jax.tree.structure(optax.sgd(0.1, momentum=0.9).init(params)))


@pytest.mark.parametrize("name", sorted(optimizers()))
def test_a_single_process_checkpoint_restores_and_training_continues(comm, name):
  """The original script: plain optax in one process on the global batch, saved after 3
  steps through flax's serialization; its own resume runs 4 more. The port restores the same
  bytes into the wrapped optimizer on every rank and runs the same 4 steps on its shards."""
  tx = optimizers()[name]
  replicas = comm.num_replicas
  original = make_step(tx)
  params, opt_state = init_params(), tx.init(init_params())
  for t in range(3):
    params, opt_state = original(params, opt_state, *global_batch(t, replicas))
  saved = serialization.msgpack_serialize(
      {"params": serialization.to_state_dict(params),
       "opt_state": serialization.to_state_dict(opt_state)})

  def restore(target_tx):
    loaded = serialization.msgpack_restore(saved)
    return (serialization.from_state_dict(init_params(), loaded["params"]),
            serialization.from_state_dict(target_tx.init(init_params()), loaded["opt_state"]))

  # The original's own resume.
  ref_params, ref_state = restore(tx)
  for t in range(3, 7):
    ref_params, ref_state = original(ref_params, ref_state, *global_batch(t, replicas))

  wrapped = mnjax.create_multi_node_optimizer(tx, comm)
  port_params, port_state = restore(wrapped)
  # Momentum and the schedule's count come back, bitwise.
  for a, b in zip(jax.tree.leaves(port_state), jax.tree.leaves(opt_state)):
    assert np.array_equal(a, b)
  counts = [leaf for leaf in jax.tree.leaves(port_state) if leaf.dtype == jnp.int32]
  assert counts and all(int(c) == 3 for c in counts)
  port = make_step(wrapped)
  mine = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
  for t in range(3, 7):
    x, y = global_batch(t, replicas)
    port_params, port_state = port(port_params, port_state, x[mine], y[mine])
  # The mean of the shards' mean-loss gradients is the global batch's: equal to rounding.
  for a, b in zip(jax.tree.leaves((port_params, port_state)),
                  jax.tree.leaves((ref_params, ref_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
  mnjax.check_replicas((port_params, port_state), comm)


@pytest.mark.parametrize("options", [{}, {"wire_dtype": jnp.bfloat16, "bucket_bytes": 16},
                                     {"mean": False, "bucket_bytes": None}])
def test_averages_like_allreduce_gradients_in_a_chain(comm, options):
  tx = optax.adam(1e-2)
  params = init_params()
  # A different gradient on every rank: the exchange is what is compared.
  x, y = global_batch(comm.rank + 100, 1)
  wrapped = make_step(mnjax.create_multi_node_optimizer(tx, comm, **options))
  chain_tx = optax.chain(mnjax.allreduce_gradients(comm, **options), tx)
  chained = make_step(chain_tx)
  got = wrapped(params, tx.init(params), x, y)
  expected_params, expected_state = chained(params, chain_tx.init(params), x, y)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((expected_params, expected_state[1]))):
    assert np.array_equal(a, b)
  if comm.size > 1:  # the exchange ran: Adam's first moment is not this rank's gradient's
    alone = make_step(tx)(params, tx.init(params), x, y)
    assert not np.array_equal(got[1][0].mu["w"], alone[1][0].mu["w"])


def test_extra_arguments_reach_the_inner_optimizer(comm):
  tx = optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
  wrapped = mnjax.create_multi_node_optimizer(tx, comm)
  params = init_params()
  grads = jax.tree.map(jnp.ones_like, params)
  state, alone = wrapped.init(params), tx.init(params)
  for value in (1.0, 2.0, 3.0):  # the loss never improves: the plateau lowers the scale
    _, state = jax.jit(wrapped.update)(grads, state, params, value=jnp.asarray(value))
    _, alone = tx.update(grads, alone, params, value=jnp.asarray(value))
  assert float(state.scale) == float(alone.scale) < 1.0


def test_ranks_with_different_options_are_stopped_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  wire = jnp.bfloat16 if comm.rank == comm.size - 1 else None
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1), comm, wire_dtype=wire)
  params = init_params()
  with pytest.raises(ValueError, match=r"wire_dtype is 'bfloat16' vs 'None'") as info:
    make_step(tx)(params, tx.init(params), *global_batch(0, 1))
  assert len(set(comm.mpi_comm.allgather(str(info.value)))) == 1


def test_double_buffering_first_runs_the_optimizer_at_the_second_step(comm):
  tx = mnjax.create_multi_node_optimizer(optax.adam(0.1), comm, double_buffering=True)
  params = init_params()
  state = tx.init(params)
  assert isinstance(state, mnjax.optim.DoubleBufferingState)
  step = jax.jit(tx.update)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = step(grads, state, params)  # stores the gradient; adam not run yet
  assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
  assert int(state.inner_state[0].count) == 0
  updates, state = step(grads, state, params)
  assert int(state.inner_state[0].count) == 1


def test_arguments_are_checked_when_built(comm):
  with pytest.raises(TypeError, match=r"create_multi_node_optimizer\(tx, comm\).*swapped"):
    mnjax.create_multi_node_optimizer(comm, optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"optax GradientTransformation.*got int"):
    mnjax.create_multi_node_optimizer(3, comm)
  with pytest.raises(TypeError, match=r"create_multi_node_optimizer needs an mnjax"
                                      r" Communicator"):
    mnjax.create_multi_node_optimizer(optax.sgd(0.1), None)
  with pytest.raises(TypeError, match=r"create_multi_node_optimizer: .*mean must be a bool"):
    mnjax.create_multi_node_optimizer(optax.sgd(0.1), comm, mean=1)


@pytest.mark.parametrize("double_buffering", [False, True])
def test_another_actual_optimizer_on_one_rank_is_named_on_every_rank(comm, double_buffering):
  """Under the user's own jax.jit: sgd(0.2) on the last rank, sgd(0.1) elsewhere (or adam)
  would leave the replicas drifting apart; the wrapper compares the programs it wraps."""
  if comm.size < 2:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  last = comm.rank == comm.size - 1
  for odd in (optax.sgd(0.2), optax.adam(0.1)):
    tx = mnjax.create_multi_node_optimizer(odd if last else optax.sgd(0.1), comm,
                                           double_buffering=double_buffering)
    params = init_params()
    with pytest.raises(ValueError, match=r"the update of the optimizer it wraps") as info:
      jax.jit(tx.update)(params, tx.init(params), params)
    assert len(set(comm.mpi_comm.allgather(str(info.value)))) == 1
  same = mnjax.create_multi_node_optimizer(optax.sgd(0.1), comm,
                                           double_buffering=double_buffering)
  params = init_params()
  jax.jit(same.update)(params, same.init(params), params)  # the same everywhere: runs
