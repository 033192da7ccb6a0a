"""replace_inner_state: a ported script's saved optimizer state, restored into every wrapper's
state, keeps its momentum, moments and counts, and training continues from them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax


def params():
  return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.zeros(2)}


def saved_adam_state(tx, steps=3):
  """The state the original (single-process) script saved after `steps` updates."""
  p, state = params(), tx.init(params())
  for _ in range(steps):
    updates, state = tx.update(jax.tree.map(jnp.ones_like, p), state, p)
    p = optax.apply_updates(p, updates)
  return state


WRAPPERS = {
    "double_buffering": lambda tx, comm: mnjax.create_multi_node_optimizer(
        tx, comm, double_buffering=True),
    "skip_nonfinite": lambda tx, comm: mnjax.skip_nonfinite(tx),
    "dynamic_loss_scale": lambda tx, comm: mnjax.optim.dynamic_loss_scale(tx),
    "accumulate_gradients": lambda tx, comm: mnjax.accumulate_gradients(tx, 2),
}


@pytest.mark.parametrize("name", WRAPPERS)
def test_the_saved_state_is_where_the_wrapper_keeps_it(comm, name):
  tx = optax.adam(1e-2)
  saved = saved_adam_state(tx)
  wrapped = WRAPPERS[name](tx, comm)
  state = mnjax.optim.replace_inner_state(wrapped.init(params()), saved)
  assert jax.tree.structure(state) == jax.tree.structure(wrapped.init(params()))
  inner = state
  while hasattr(inner, "inner_state"):
    inner = inner.inner_state
  assert int(inner[0].count) == 3
  for a, b in zip(jax.tree.leaves(inner), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)


def test_training_continues_from_the_saved_moments(comm):
  """Double buffering: the second step applies Adam's update number 4, from the saved
  moments, as the original script's next update would have (one step stale)."""
  tx = optax.adam(1e-2)
  saved = saved_adam_state(tx)
  wrapped = mnjax.create_multi_node_optimizer(tx, comm, double_buffering=True)
  p = params()
  state = mnjax.optim.replace_inner_state(wrapped.init(p), saved)
  grads = jax.tree.map(jnp.ones_like, p)
  update = jax.jit(wrapped.update)
  _, state = update(grads, state, p)
  updates, state = update(grads, state, p)
  want, _ = tx.update(grads, saved, p)
  assert int(state.inner_state[0].count) == 4
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_what_cannot_be_restored_this_way_is_refused(comm):
  tx = optax.adam(1e-2)
  with pytest.raises(TypeError, match="scatter_optimizer_state"):
    sharded = mnjax.shard_optimizer(tx, comm).init(params())
    mnjax.optim.replace_inner_state(sharded, tx.init(params()))
  with pytest.raises(TypeError, match="restore the saved state as it is"):
    mnjax.optim.replace_inner_state(tx.init(params()), tx.init(params()))
  wrapped = mnjax.skip_nonfinite(tx)
  with pytest.raises(TypeError, match="has the tree"):
    mnjax.optim.replace_inner_state(wrapped.init(params()), optax.sgd(0.1).init(params()))
  with pytest.raises(TypeError, match=r"leaf .* is float32\[3, 2\], the state given has"
                                      r" float32\[2, 2\]"):
    mnjax.optim.replace_inner_state(wrapped.init(params()),
                                    tx.init({"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}))
