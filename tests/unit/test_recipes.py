"""Large-minibatch recipes: the schedule's values at its corners, what gets weight decay,
label smoothing's loss, LARS leaving norm/bias parameters to plain momentum, and Akiba et
al.'s recipe: the blend and slow start at their corners, the update step by step against the
formulas, each bad argument's error, and the imagenet_15min config building its optimizer."""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.launch import REPO

from lab.models import ResNet18
from mnjax.optim import recipes

sys.path.insert(0, str(REPO / "experiments"))
import imagenet  # the ResNet experiment


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
  params = jax.eval_shape(  # the tree's names and shapes are all the mask reads
      lambda: ResNet18(num_classes=10, stem="cifar").init(
          jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)["params"])
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


# Akiba et al. 2017 ------------------------------------------------------------------------

def test_akiba_blend_at_its_corners():
  spe, c, p = 8, 10.0, 5.0
  alpha = recipes.akiba_blend(spe)  # the paper's centre 10, period 5
  at = lambda epoch, offset=0: float(alpha(round(epoch * spe) + offset))
  assert at(0) == close(0.5 * math.exp(-4.0))                  # e = 0: 0.9% SGD
  assert at(c, -1) == close(0.5 * math.exp(2 * (-1 / spe) / p))  # just before c
  assert at(c) == close(0.5)                                    # e = c: half and half
  assert at(c + p / 4) == close(0.75)                           # on the straight piece
  assert at(c + p / 2, -1) == close(1.0 - 1 / (spe * p))        # just before c + p/2
  assert at(c + p / 2) == 1.0 and at(c + p) == 1.0 and at(90) == 1.0 and at(10**6) == 1.0
  other = recipes.akiba_blend(4, center=2.0, period=1.0)
  assert [float(other(s)) for s in (8, 9, 10)] == [close(0.5), close(0.75), 1.0]
  assert float(other(0)) == close(0.5 * math.exp(-4.0))


def test_akiba_blend_is_continuous_in_value_and_slope_at_the_centre():
  spe, c, p = 8, 10.0, 5.0
  alpha = recipes.akiba_blend(spe)
  step_c = c * spe
  h = 1e-2  # in steps
  rise = 1 / (p * spe)  # per step
  # No jump: each side is 0.5 plus its slope times the distance (the old "1.5 then 1" jumped).
  assert float(alpha(step_c - h)) == pytest.approx(0.5 - h * rise, abs=1e-6)
  assert float(alpha(step_c + h)) == pytest.approx(0.5 + h * rise, abs=1e-6)
  slope = jax.grad(lambda s: alpha(s))
  left, right = float(slope(step_c - h)), float(slope(step_c + h))
  # Both pieces rise at 1/p per epoch there (the printed "2 (e - c) / p" would give 2/p).
  assert left == pytest.approx(rise, rel=1e-3)
  assert right == pytest.approx(rise, rel=1e-6)


def test_slow_start_schedule_at_each_boundary():
  spe = 39  # ImageNet's 1.28M images / 32768
  eta = recipes.slow_start_schedule(32768, spe)
  base = 0.1 * 32768 / 256  # 12.8
  at = lambda epoch, offset=0: float(eta(epoch * spe + offset))
  assert at(0) == close(0.5 * base) == close(6.4)
  for epoch, before, after in ((40, 0.5, 0.075), (70, 0.075, 0.01), (85, 0.01, 0.001)):
    assert at(epoch, -1) == close(before * base), epoch
    assert at(epoch) == close(after * base), epoch
  assert at(90, -1) == close(0.001 * base) and at(90) == close(0.001 * base)  # the run's end
  small = recipes.slow_start_schedule(1024, 10, base_lr=0.2, base_batch_size=512)
  assert float(small(0)) == close(0.5 * 0.4) and float(small(400)) == close(0.075 * 0.4)


def numpy_rmsprop_warmup(grads, eta, eta_rms, alpha_sgd, mu1, mu2, eps):
  """The issue's formulas, transcribed in float64 over a list of {name: array} gradients."""
  m = {k: np.zeros_like(v, np.float64) for k, v in grads[0].items()}
  delta = {k: np.zeros_like(v, np.float64) for k, v in grads[0].items()}
  out = []
  for t, g in enumerate(grads):
    alpha_rms = (1 - alpha_sgd(t)) * eta_rms(t) / eta(t)
    step = {}
    for k in g:
      gk = np.asarray(g[k], np.float64)
      m[k] = mu2 * m[k] + (1 - mu2) * gk**2
      delta[k] = mu1 * delta[k] - (alpha_sgd(t) + alpha_rms / (np.sqrt(m[k]) + eps)) * gk
      step[k] = eta(t) * delta[k]
    out.append(step)
  return out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_rmsprop_warmup_follows_the_formulas_step_by_step(jit):
  rng = np.random.default_rng(0)
  grads = [{"a": rng.normal(size=3).astype(np.float32) * 10.0 ** (t % 3 - 1),
            "b": rng.normal(size=(2, 2)).astype(np.float32)} for t in range(7)]
  params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
  eta = lambda t: 0.5 + 0.25 * t            # a schedule for SGD's rate
  eta_rms = lambda t: 1e-2 * (1 + t)        # and one for RMSprop's
  # 2 steps per epoch, centre 1, period 2: steps 0-1 exponential, 2-3 straight, 4- all SGD.
  blend = recipes.akiba_blend(2, center=1.0, period=2.0)
  alphas = [float(blend(t)) for t in range(7)]
  assert alphas[2] == close(0.5) and alphas[3] == close(0.75) and alphas[4:] == [1.0] * 3
  tx = recipes.rmsprop_warmup(eta, blend, rmsprop_learning_rate=eta_rms, momentum=0.8,
                              decay=0.9, eps=1e-3)
  expected = numpy_rmsprop_warmup(grads, eta, eta_rms, lambda t: alphas[t], 0.8, 0.9, 1e-3)
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for t, g in enumerate(grads):
    got, state = update(jax.tree.map(jnp.asarray, g), state)
    for k in g:
      np.testing.assert_allclose(got[k], expected[t][k], rtol=2e-5, atol=1e-7,
                                 err_msg=f"step {t}, leaf {k}")
  assert int(state.count) == len(grads)


def test_rmsprop_warmup_at_sgd_fraction_one_is_momentum_sgd():
  grads = [{"w": jnp.array([0.5, -2.0])}, {"w": jnp.array([1.5, 0.25])},
           {"w": jnp.array([-1.0, 1.0])}]
  params = {"w": jnp.zeros(2)}
  eta = lambda t: 0.1 / (1 + t)
  tx, sgd = recipes.rmsprop_warmup(eta, 1.0), optax.sgd(eta, momentum=0.9)
  s1, s2 = tx.init(params), sgd.init(params)
  for g in grads:
    u1, s1 = tx.update(g, s1)
    u2, s2 = sgd.update(g, s2)
    np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6)


def test_rmsprop_warmup_takes_rmsprops_own_rate_not_sgds():
  # The bug this replaces: lr x (1 - a) / sqrt(nu) moved each coordinate by ~SGD's rate (6.4).
  tx = recipes.rmsprop_warmup(6.4, 0.0, decay=0.0)  # decay 0: m = g**2, steps of eta_rmsprop
  update, _ = tx.update({"w": jnp.array([1e-3, -50.0])}, tx.init({"w": jnp.zeros(2)}))
  np.testing.assert_allclose(update["w"], [-3e-4, 3e-4], rtol=1e-4)


@pytest.mark.parametrize("build, message", [
    (lambda: recipes.rmsprop_warmup(0.0, 1.0), "learning_rate must be > 0"),
    (lambda: recipes.rmsprop_warmup(-0.1, 1.0), "learning_rate must be > 0"),
    (lambda: recipes.rmsprop_warmup(0.1, 1.0, rmsprop_learning_rate=0.0),
     "rmsprop_learning_rate must be > 0"),
    (lambda: recipes.rmsprop_warmup(0.1, 1.5), r"sgd_fraction must be in \[0, 1\]"),
    (lambda: recipes.rmsprop_warmup(0.1, 1.0, momentum=1.0),
     r"momentum must be in \[0, 1\) \(Akiba et al.'s recipe: 0.9\), got 1.0"),
    (lambda: recipes.rmsprop_warmup(0.1, 1.0, momentum=-0.5), r"momentum must be in \[0, 1\)"),
    (lambda: recipes.rmsprop_warmup(0.1, 1.0, decay=1.0),
     r"decay must be in \[0, 1\) \(Akiba et al.'s recipe: 0.99\)"),
    (lambda: recipes.rmsprop_warmup(0.1, 1.0, eps=0.0), "eps must be > 0"),
    (lambda: recipes.akiba_blend(0), "akiba_blend: steps_per_epoch must be a positive integer"),
    (lambda: recipes.akiba_blend(39.5), "steps_per_epoch must be a positive integer"),
    (lambda: recipes.akiba_blend(39, period=0.0), "period must be > 0 epochs"),
    (lambda: recipes.akiba_blend(39, period=-5.0), "period must be > 0 epochs"),
    (lambda: recipes.slow_start_schedule(32768, 0),
     "slow_start_schedule: steps_per_epoch must be a positive integer"),
    (lambda: recipes.slow_start_schedule(32768, 39, base_lr=0.0), "base_lr must be > 0"),
    (lambda: recipes.slow_start_schedule(0, 39), "batch sizes must be >= 1"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_fail_at_construction_with_the_fix(build, message):
  with pytest.raises(ValueError, match=message):
    build()


def test_imagenet_15min_config_builds_the_akiba_optimizer():
  config = imagenet.parse_args(["--config", "imagenet_15min"])
  assert (config.model, config.global_batch_size, config.epochs) == ("resnet50", 32768, 90)
  assert (config.optimizer, config.blend_center, config.blend_period) == (
      "rmsprop_warmup", 10.0, 5.0)
  assert config.sync_bn and config.bn_momentum == 0.0 and config.wire_dtype == "float16"
  assert config.label_smoothing == 0.1
  steps = 1281167 // config.global_batch_size  # 39
  tx = imagenet.optimizer(config, steps)
  params = {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"kernel": jnp.full((2, 2), 1e-3), "bias": jnp.full(2, 1e-3)}
  update, state = tx.update(grads, state, params)
  # Step 0: eta = 6.4, alpha_sgd = 0.5 e^-4; the RMSprop part moves by 10 x (1 - a) x 3e-4.
  a = 0.5 * math.exp(-4.0)
  expected = -(6.4 * a * 1e-3 + (1 - a) * 3e-4 / (math.sqrt(0.01) * 1e-3 + 1e-8) * 1e-3)
  np.testing.assert_allclose(update["bias"], [expected] * 2, rtol=1e-5)
