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


@pytest.mark.parametrize("kind", KINDS)
def test_get_metrics_reads_the_global_mean_of_a_metric_reduced_in_the_step(kind):
  """README step 7: flax's `common_utils.get_metrics` keeps local device 0's row. A metric
  reduced in the step by `allreduce_tree` has the global batch's mean in every row, on every
  rank; one not reduced is device 0's own value (why step 7 never takes row 0 of it)."""
  from flax.training import common_utils

  kc = mnjax.create_communicator(kind)
  per_process = 2 * kc.local_device_count  # two examples per device

  def step(x):
    loss = (x ** 2).mean()
    return mnjax.comm.allreduce_tree({"loss": loss}, kc), {"loss": loss}

  run = mnjax.data_parallel(step, kc, batch_argnums=(0,), per_device_outputs=(0, 1))
  history, want_global, want_device0 = [], [], []
  for s in range(3):  # three steps, each on a global batch every rank can rebuild
    batch = np.arange(kc.size * per_process, dtype=np.float32) / 4 + s
    x = batch[kc.rank * per_process:(kc.rank + 1) * per_process]
    history.append(run(x))
    want_global.append((batch ** 2).mean())
    want_device0.append((x[:2] ** 2).mean())
  reduced = common_utils.get_metrics([reduced for reduced, _ in history])
  own = common_utils.get_metrics([own for _, own in history])
  np.testing.assert_allclose(reduced["loss"], want_global, rtol=1e-6)
  np.testing.assert_allclose(own["loss"], want_device0, rtol=1e-6)
  if kc.num_replicas > 1:  # device 0's own value is not the batch's
    assert not np.allclose(own["loss"], want_global, rtol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_replica_index_numbers_every_replica_of_the_job_once(kind):
  """`mnjax.train.replica_index` inside the step is ``rank * local devices + the local
  device's``, so dropout keys folded from it differ on every replica of the job (where
  ``lax.axis_index`` repeats on every process), with one program on every rank."""
  import jax

  kc = mnjax.create_communicator(kind)
  n = kc.local_device_count

  def step(key):
    index = mnjax.train.replica_index(kc)
    return jax.random.bits(jax.random.fold_in(key, index), (4,)), index

  bits, index = mnjax.data_parallel(step, kc, batch_argnums=(), per_device_outputs=(0, 1))(
      jax.random.key(0))
  assert index.dtype == jnp.int32 and index.tolist() == [kc.rank * n + i for i in range(n)]
  rows = np.asarray(kc.allgather(np.asarray(bits))).reshape(-1, 4)  # every replica's bits
  assert len(rows) == kc.num_replicas and len({tuple(r) for r in rows}) == kc.num_replicas
