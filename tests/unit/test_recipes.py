"""Large-minibatch recipes: the schedule's values at its corners, what gets weight decay,
label smoothing's loss, and LARS leaving norm/bias parameters to plain momentum."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mnjax.models import ResNet18
from mnjax.optim import recipes


def close(value):
  return pytest.approx(value, rel=1e-5)  # schedules compute in float32


def test_linear_scaling_rule():
  assert recipes.linear_scaling(256) == pytest.approx(0.1)
  assert recipes.linear_scaling(8192) == pytest.approx(3.2)
  with pytest.raises(ValueError, match="batch sizes must be >= 1"):
    recipes.linear_scaling(0)


def test_goyal_schedule_warms_up_linearly_then_divides_by_ten_at_30_60_80():
  spe = 156  # ImageNet's 1.28M images / 8192
  s = recipes.goyal_schedule(8192, spe)
  at = lambda epoch, offset=0: float(s(int(epoch * spe) + offset))
  assert at(0) == close(0.1)                        # warmup starts at 0.1
  assert at(2.5) == close(0.1 + (3.2 - 0.1) / 2)    # linear halfway
  assert at(5) == close(3.2)                        # k x 0.1 with k = 32
  assert at(30, -1) == close(3.2) and at(30) == close(0.32)
  assert at(60) == close(0.032) and at(80) == close(0.0032)
  assert at(89) == close(0.0032)
  no_warmup = recipes.goyal_schedule(256, 10, warmup_epochs=0)
  assert float(no_warmup(0)) == close(0.1) and float(no_warmup(300)) == close(0.01)


def test_decay_mask_spares_norm_parameters_and_biases():
  params = ResNet18(num_classes=10, stem="cifar").init(
      jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)["params"]
  mask = recipes.decay_mask(params)
  for path, decays in jax.tree_util.tree_flatten_with_path(mask)[0]:
    name = jax.tree_util.keystr(path)
    assert decays == name.endswith("['kernel']"), name


def test_goyal_sgd_decays_kernels_only():
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
  tx = recipes.goyal_sgd(256, 10, momentum=0.0, weight_decay=0.5)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)  # zero gradient: decay only
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.5 * np.ones((2, 2)))
  np.testing.assert_allclose(updates["dense"]["bias"], np.zeros(2))


def test_label_smoothing_matches_its_definition():
  logits = jnp.array([[2.0, 0.0, -1.0]])
  log_p = jax.nn.log_softmax(logits)[0]
  eps = 0.3
  expected = -((1 - eps) * log_p[0] + eps / 3 * jnp.sum(log_p))
  loss = recipes.smoothed_cross_entropy(logits, jnp.array([0]), eps)[0]
  assert float(loss) == pytest.approx(float(expected))
  with pytest.raises(ValueError, match="smoothing must be in"):
    recipes.smoothed_cross_entropy(logits, jnp.array([0]), 1.0)


def test_lars_scales_kernels_by_trust_ratio_but_not_biases():
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 2.0)}
  grads = {"kernel": jnp.full((4, 4), 1.0), "bias": jnp.full((4,), 1.0)}
  tx = recipes.lars(1.0, weight_decay=0.0, momentum=0.0, trust_coefficient=0.5)
  updates, _ = tx.update(grads, tx.init(params), params)
  # Trust ratio = coefficient x |w| / |g| = coefficient x 2, applied to the kernel only.
  np.testing.assert_allclose(updates["kernel"], -1.0 * np.ones((4, 4)))
  np.testing.assert_allclose(updates["bias"], -1.0 * np.ones(4))
  tx = recipes.lars(1.0, weight_decay=0.0, momentum=0.0, trust_coefficient=0.25)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["kernel"], -0.5 * np.ones((4, 4)))  # ratio 0.5
  np.testing.assert_allclose(updates["bias"], -1.0 * np.ones(4))         # untouched


def test_blend_schedule_values():
  alpha = recipes.blend_schedule(steps_per_epoch=10, begin_epoch=2, end_epoch=6)
  assert [float(alpha(s)) for s in (0, 20, 30, 40, 60, 1000)] == [0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
  with pytest.raises(ValueError, match="begin_epoch < end_epoch"):
    recipes.blend_schedule(10, 5, 5)


def test_rmsprop_warmup_is_rmsprop_first_and_momentum_sgd_after_the_blend():
  grads = [{"w": jnp.array([0.5, -2.0])}, {"w": jnp.array([1.5, 0.25])},
           {"w": jnp.array([-1.0, 1.0])}]
  params = {"w": jnp.zeros(2)}
  # After the blend (a = 1) it is momentum SGD exactly.
  tx, sgd = recipes.rmsprop_warmup(0.1, 1.0, momentum=0.9), optax.sgd(0.1, momentum=0.9)
  s1, s2 = tx.init(params), sgd.init(params)
  for g in grads:
    u1, s1 = tx.update(g, s1)
    u2, s2 = sgd.update(g, s2)
    np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6)
  # At the start (a = 0) each coordinate moves by lr * g / sqrt(nu): RMSprop's step.
  tx = recipes.rmsprop_warmup(0.1, recipes.blend_schedule(1, 0, 2), momentum=0.0, decay=0.5)
  state = tx.init(params)
  update, state = tx.update(grads[0], state)
  nu = 0.5 * grads[0]["w"] ** 2
  np.testing.assert_allclose(update["w"], -0.1 * grads[0]["w"] / (np.sqrt(nu) + 1e-8), rtol=1e-6)
  update, state = tx.update(grads[1], state)  # step 1 of 2: half SGD, half RMSprop
  nu = 0.5 * nu + 0.5 * grads[1]["w"] ** 2
  expected = -0.1 * (0.5 + 0.5 / np.sqrt(nu)) * grads[1]["w"]
  np.testing.assert_allclose(update["w"], expected, rtol=1e-6)
