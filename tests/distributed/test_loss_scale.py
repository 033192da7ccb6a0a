"""dynamic_loss_scale (flax's DynamicScale, agreed by every rank): what a script ported from
flax's fp16 pmap examples relies on.

Runs in one process and under mpirun (2 and 3 ranks): assertions are written in `comm.size`.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.optim import dynamic_loss_scale, loss_scale_state

# -- dynamic loss scaling (flax's DynamicScale) ----------------------------------------------

def scaled_step(tx):
  """One step of a linear model whose gradient is `x` (so each rank picks its gradient)."""

  @jax.jit
  def step(params, opt_state, x):
    scale = loss_scale_state(opt_state).scale
    grads = jax.grad(lambda p: (p["w"] * x).sum() * scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def test_a_nan_on_one_rank_makes_every_rank_skip_and_lower_the_scale(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm),
                   dynamic_loss_scale(optax.sgd(0.5), initial_scale=1024.0, growth_interval=2))
  step, params = scaled_step(tx), {"w": jnp.zeros(3)}
  opt_state = tx.init(params)
  good = np.full(3, comm.rank + 1.0, np.float32)  # mean over ranks: (size + 1) / 2
  bad = np.array([1.0, np.nan, 1.0], np.float32) if comm.rank == comm.size - 1 else good
  history = []
  for x in [good, bad, good, good, good]:
    params, opt_state = step(params, opt_state, x)
    ls = loss_scale_state(opt_state)
    history.append((float(ls.scale), int(ls.good_steps), bool(ls.finite), float(params["w"][0])))
  lr_mean = 0.5 * (comm.size + 1) / 2
  assert history == [(1024.0, 1, True, -lr_mean),
                     (512.0, 0, False, -lr_mean),  # skipped everywhere, the scale halved
                     (512.0, 1, True, -2 * lr_mean),
                     (1024.0, 0, True, -3 * lr_mean),  # two finite steps in a row: doubled
                     (1024.0, 1, True, -4 * lr_mean)]
  assert int(opt_state[1].inner_state.skipped) == 1
  digest = hashlib.sha256(b"".join(np.asarray(v).tobytes()
                                   for v in jax.tree.leaves((params, opt_state)))).hexdigest()
  assert len(set(comm.mpi_comm.allgather(digest))) == 1  # the replicas stayed identical


def test_scaling_keeps_float16_gradients_that_would_underflow(comm):
  def loss(p):  # the product is float16: its gradient, 1e-8, is below float16's 6e-8
    return (p["w"].astype(jnp.float16) * 1e-4).sum() * 1e-4

  params = {"w": jnp.ones(2)}
  assert float(jax.grad(loss)(params)["w"][0]) == 0.0  # flushed to zero unscaled
  tx = optax.chain(mnjax.allreduce_gradients(comm), dynamic_loss_scale(optax.sgd(1.0)))
  opt_state = tx.init(params)
  scale = loss_scale_state(opt_state).scale
  updates, _ = jax.jit(tx.update)(jax.grad(lambda p: loss(p) * scale)(params), opt_state, params)
  np.testing.assert_allclose(updates["w"], -1e-8, rtol=1e-2)


def test_the_scale_stays_within_its_bounds(comm):
  tx = dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0, growth_interval=1, min_scale=2.0)
  step, params = scaled_step(tx), {"w": jnp.zeros(1)}
  opt_state = tx.init(params)
  scales = []
  for x in [np.inf, np.inf, 1.0]:
    params, opt_state = step(params, opt_state, np.full(1, x, np.float32))
    scales.append(float(loss_scale_state(opt_state).scale))
  assert scales == [2.0, 2.0, 4.0]
  huge = tx.init(params)._replace(scale=jnp.float32(3e38))  # growing would overflow: kept
  _, huge = step(params, huge, np.ones(1, np.float32))
  assert float(loss_scale_state(huge).scale) == np.float32(3e38)
  with pytest.raises(FloatingPointError, match="2 consecutive steps"):
    for x in [np.nan, np.nan]:
      params, opt_state = step(params, opt_state, np.full(1, x, np.float32))
    mnjax.optim.raise_if_diverging(opt_state, max_consecutive_skips=1)  # finds the inner skip state


@pytest.mark.parametrize("bad, match", [
    ({"backoff_factor": 1.0}, "backoff_factor must be in"),
    ({"growth_factor": 0.5}, "growth_factor must be >= 1"),
    ({"initial_scale": 0.5}, "initial_scale must be >= min_scale"),
    ({"min_scale": float("nan")}, "min_scale must be a finite number"),
    ({"growth_interval": 0}, "growth_interval must be an int >= 1")])
def test_bad_arguments_are_refused_when_built(bad, match):
  with pytest.raises(ValueError, match=match):
    dynamic_loss_scale(optax.sgd(0.1), **bad)
  with pytest.raises(TypeError, match="wraps an optax.GradientTransformation"):
    dynamic_loss_scale(lambda g: g)
  with pytest.raises(ValueError, match="holds 0 dynamic_loss_scale states"):
    loss_scale_state(optax.sgd(0.1).init({"w": jnp.ones(1)}))
