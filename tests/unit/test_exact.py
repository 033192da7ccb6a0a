"""`mnjax/comm/_instep/_exact.py`: integer-limb sums whose bits do not depend on the order or the
grouping of the summands, within the stated error of the exact sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mnjax.comm._instep import _exact as exact

V = 12


def replicas(seed=0, n=4000):
  """V replicas' float32 values over many magnitudes, signs mixed."""
  rng = np.random.default_rng(seed)
  scale = np.exp(rng.uniform(-30, 10, (V, n)))
  return (rng.standard_normal((V, n)) * scale).astype(np.float32)


def summed(values):
  """`exact_sum` over the leading axis, the summands' int32 limbs added by a psum."""
  def one(x):
    return exact.exact_sum(x, V, lambda y, after: jax.lax.psum(y, "r"), None)
  return np.asarray(jax.jit(jax.vmap(one, axis_name="r"))(jnp.asarray(values))[0])


def test_the_bits_do_not_depend_on_the_order_of_the_replicas():
  """Any order of the replicas gives the same bits; float32's own sum does not (the test
  would notice an order-dependent sum)."""
  values = replicas()
  orders = [np.random.default_rng(k).permutation(V) for k in range(4)]
  results = [summed(values[order]) for order in orders]
  for r in results[1:]:
    np.testing.assert_array_equal(r, results[0])
  floats = [np.sum(values[order], axis=0, dtype=np.float32) for order in orders]
  assert any(not np.array_equal(f, floats[0]) for f in floats[1:])


@pytest.mark.parametrize("seed", [0, 1])
def test_within_the_stated_error_of_the_exact_sum(seed):
  """|result - sum| <= error_bound (the limbs' truncation) + float32's rounding of the sum
  (twice: 2 ** -23 relative)."""
  values = replicas(seed)
  want = values.astype(np.float64).sum(axis=0)
  got = summed(values).astype(np.float64)
  bound = exact.error_bound(float(np.abs(values).max()), V) + 2.0 ** -23 * np.abs(want)
  assert np.all(np.abs(got - want) <= bound)
  # Entries far above the truncation are as good as a correctly rounded float32 sum.
  big = np.abs(want) > 1e6 * exact.error_bound(float(np.abs(values).max()), V)
  assert big.sum() > 100
  np.testing.assert_allclose(got[big], want[big], rtol=2.0 ** -22)


def test_zeros_tiny_and_huge_values():
  values = np.zeros((V, 5), np.float32)
  values[:, 1] = 3.0e38 / V  # near float32's largest, summing to it
  values[0, 2] = 1.0e-30
  values[3, 3] = -7.5
  got = summed(values)
  np.testing.assert_allclose(got[1], 3.0e38, rtol=1e-6)
  assert np.isfinite(got).all()
  # Below 2 ** (e - 52) of the largest (e = 128) counts as zero, as stated.
  assert got[0] == 0.0 and got[2] == 0.0 and got[3] == 0.0
  values[:, 1] = 0.0  # now the largest is 7.5: everything exact
  got = summed(values)
  assert got[0] == 0.0 and got[2] == 0.0 and got[3] == -7.5


def test_only_float32_buffers():
  with pytest.raises(ValueError, match="float32 buffers"):
    exact.exact_sum(jnp.ones(3, jnp.bfloat16), 2, lambda x, after: x, None)
