"""data_parallel's per-device outputs, as a script ported from ``jax.pmap`` returns them.

Each kind runs here as 1 (flat) or 1 x 2 (processes x devices), and under mpirun as 2 and 3
processes (x 2 devices for the multi-device kinds).
"""

import jax.numpy as jnp
import numpy as np
import pytest

import mnjax

# single_node runs several processes when they share one node (ChainerMN's single_node).
KINDS = ["flat", "hierarchical", "two_dimensional", "single_node"]


@pytest.mark.parametrize("kind", KINDS)
def test_python_numbers_in_per_device_outputs_give_one_row_per_device_like_pmap(kind):
  kc = mnjax.create_communicator(kind)
  n = kc.local_device_count

  def step(params, x):
    metrics = {"loss": x.sum(), "count": 32, "weight": 0.5, "finite": True}
    return params, metrics, 7, 3  # 7 per device; 3 replicated

  run = mnjax.data_parallel(step, kc, per_device_outputs=(1, 2))
  x = np.arange(2.0 * n, dtype=np.float32)  # two examples per device
  params, metrics, seven, three = run(jnp.ones(3), x)
  np.testing.assert_array_equal(metrics["loss"], x.reshape(n, 2).sum(1))
  for value, want, dtype in [(metrics["count"], 32, jnp.int32), (seven, 7, jnp.int32),
                             (metrics["weight"], 0.5, jnp.float32),
                             (metrics["finite"], True, jnp.bool_)]:
    assert value.shape == (n,) and value.dtype == dtype
    np.testing.assert_array_equal(value, np.full(n, want))
  assert np.shape(three) == () and int(three) == 3
  np.testing.assert_array_equal(params, np.ones(3))


@pytest.mark.parametrize("kind", KINDS)
def test_a_leaf_that_is_not_an_array_names_the_output_and_the_fix(kind):
  kc = mnjax.create_communicator(kind)
  run = mnjax.data_parallel(lambda p, x: (p, {"loss": x.sum(), "tag": "train"}), kc,
                            per_device_outputs=(1,))
  with pytest.raises(TypeError, match=r"per-device output 1 .* \['tag'\] of type str .*"
                                      r"Return it as a jnp array"):
    run(jnp.ones(3), np.ones(2 * kc.local_device_count, np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_per_device_outputs_need_a_tuple_that_long(kind):
  kc = mnjax.create_communicator(kind)
  x = np.ones(2 * kc.local_device_count, np.float32)
  with pytest.raises(TypeError, match="fn returned a dict. Return a tuple"):
    mnjax.data_parallel(lambda p, x: {"p": p}, kc, per_device_outputs=(0,))(jnp.ones(3), x)
  with pytest.raises(ValueError, match=r"names position 2, but fn returned 2 outputs"):
    mnjax.data_parallel(lambda p, x: (p, x.sum()), kc, per_device_outputs=(1, 2))(jnp.ones(3), x)


@pytest.mark.parametrize("argument", ["batch_argnums", "per_device_outputs"])
def test_positions_are_checked_when_the_step_is_built(comm, argument):
  # A negative position would silently replicate the batch (or keep one device's row).
  for bad in [(-1,), (1.0,), (True,), None]:
    with pytest.raises(ValueError, match=f"{argument} must be positions"):
      mnjax.data_parallel(lambda *a: a, comm, **{argument: bad})
  mnjax.data_parallel(lambda *a: a, comm, **{argument: np.int64(1)})  # one position


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_position_past_the_arguments_is_an_error_naming_their_number(kind):
  # Before: ignored under flat (nothing split), a raw IndexError under the others.
  kc = mnjax.create_communicator(kind)
  run = mnjax.data_parallel(lambda p, x: (p, x.sum()), kc, batch_argnums=(5,))
  with pytest.raises(ValueError, match=r"batch_argnums=\(5,\) names position\(s\) \[5\], but"
                                       r" the step was called with 2 argument\(s\)"):
    run(jnp.ones(3), np.ones(2 * kc.local_device_count, np.float32))
