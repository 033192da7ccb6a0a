"""A non-finite gradient on one rank skips the step on every rank, together (1-3 ranks)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax


def make(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm),
                   mnjax.skip_nonfinite(optax.sgd(0.1, momentum=0.9)))

  @jax.jit
  def step(params, opt_state, poison):
    # Every rank's gradient is finite except where `poison` puts a NaN or an Inf.
    grads = jax.tree.map(lambda p: p * (comm.rank + 1.0) + poison, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, step


def gathered(comm, tree):
  return comm.mpi_comm.allgather(jax.tree.map(np.asarray, tree))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_bad_value_on_the_last_rank_skips_the_step_on_every_rank(comm, bad):
  tx, step = make(comm)
  params = {"w": jnp.arange(4.0), "b": jnp.ones(())}
  opt_state = tx.init(params)
  params, opt_state = step(params, opt_state, 0.0)  # a finite step: momentum is now non-zero
  before_params, before_inner = params, opt_state[1].inner_state
  poison = bad if comm.rank == comm.size - 1 else 0.0
  params, opt_state = step(params, opt_state, poison)
  skip = opt_state[1]
  # Unchanged parameters and momentum, one skip counted, on every rank.
  for a, b in zip(jax.tree.leaves((params, skip.inner_state)),
                  jax.tree.leaves((before_params, before_inner))):
    np.testing.assert_array_equal(a, b)
  assert (int(skip.skipped), int(skip.consecutive)) == (1, 1)
  counters = comm.mpi_comm.allgather((int(skip.skipped), int(skip.consecutive)))
  assert counters == [(1, 1)] * comm.size
  # The next finite step applies, resets the streak, and the replicas stay identical.
  params, opt_state = step(params, opt_state, 0.0)
  assert (int(opt_state[1].skipped), int(opt_state[1].consecutive)) == (1, 0)
  assert not np.array_equal(params["w"], before_params["w"])
  replicas = gathered(comm, params)
  for other in replicas[1:]:
    for a, b in zip(jax.tree.leaves(replicas[0]), jax.tree.leaves(other)):
      np.testing.assert_array_equal(a, b)


def test_finite_steps_equal_the_unwrapped_optimizer(comm):
  tx, step = make(comm)
  plain = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1, momentum=0.9))

  @jax.jit
  def plain_step(params, opt_state):
    grads = jax.tree.map(lambda p: p * (comm.rank + 1.0), params)
    updates, opt_state = plain.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = ref = {"w": jnp.arange(4.0)}
  opt_state, ref_state = tx.init(params), plain.init(ref)
  for _ in range(3):
    params, opt_state = step(params, opt_state, 0.0)
    ref, ref_state = plain_step(ref, ref_state)
  # Equal up to XLA fusing the mean differently in the two programs (1 ulp at 3 ranks).
  np.testing.assert_allclose(params["w"], ref["w"], rtol=1e-6, atol=1e-7)
  assert int(opt_state[1].skipped) == 0


def test_too_many_consecutive_skips_raise_on_every_rank(comm):
  tx, step = make(comm)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  poison = np.nan if comm.rank == 0 else 0.0
  for _ in range(2):  # two skips in a row are allowed
    params, opt_state = step(params, opt_state, poison)
    mnjax.optim.raise_if_diverging(opt_state, max_consecutive_skips=2)
  params, opt_state = step(params, opt_state, poison)
  with pytest.raises(FloatingPointError, match=(
      r"3 consecutive steps had non-finite \(NaN or Inf\) gradients on some rank, more than"
      r" max_consecutive_skips=2")) as info:
    mnjax.optim.raise_if_diverging(opt_state, max_consecutive_skips=2)
  assert len(set(comm.mpi_comm.allgather(str(info.value)))) == 1
  # A finite step ends the streak.
  params, opt_state = step(params, opt_state, 0.0)
  mnjax.optim.raise_if_diverging(opt_state, max_consecutive_skips=0)


def test_arguments_are_checked():
  with pytest.raises(TypeError, match="wraps an optax.GradientTransformation"):
    mnjax.skip_nonfinite(lambda g: g)
  with pytest.raises(ValueError, match="max_consecutive_skips must be an int >= 0"):
    mnjax.optim.raise_if_diverging(None, max_consecutive_skips=-1)
  with pytest.raises(ValueError, match="holds no skip_nonfinite state"):
    mnjax.optim.raise_if_diverging(optax.sgd(0.1).init({"w": jnp.ones(2)}), max_consecutive_skips=1)
