"""Half precision on the wire and bucketing: values within the documented bound, NaN/Inf kept,
identical on every rank, collectives issued in one order; bad options refused up front."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _allreduce as collectives
from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep import _wire as wire

WIRES = [jnp.bfloat16, jnp.float16]


def gradients_for_rank(rank, n=3001):
  """Mixed magnitudes (1e-4..1e3, both signs) and a length no rank count divides."""
  rng = np.random.default_rng(100 + rank)
  return (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 3, n)).astype(np.float32)


def everyone(comm, x):
  return np.stack(comm.mpi_comm.allgather(np.asarray(x)))


@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("wire_dtype", WIRES)
def test_half_precision_allreduce_is_within_the_documented_bound(comm, wire_dtype, mean):
  local = gradients_for_rank(comm.rank)
  fn = jax.jit(lambda g: collectives.allreduce_tree(g, comm, mean=mean, wire_dtype=wire_dtype))
  out = np.asarray(fn({"g": jnp.asarray(local)})["g"])
  inputs = everyone(comm, local).astype(np.float64)
  exact = inputs.sum(0) / (comm.size if mean else 1)
  bound = wire.error_bound(np.abs(inputs).sum(0), comm.size, wire_dtype, mean=mean)
  error = np.abs(out - exact)
  assert np.all(error <= bound), f"worst excess {np.max(error - bound)}"
  # Identical on every rank (each chunk is summed by one rank, then gathered).
  np.testing.assert_array_equal(everyone(comm, out), np.broadcast_to(out, (comm.size, out.size)))
  if comm.size > 1 and mean:  # the values really crossed in 16 bits
    np.testing.assert_array_equal(out, out.astype(wire_dtype).astype(np.float32))


@pytest.mark.parametrize("wire_dtype", WIRES)
def test_nan_and_inf_stay_non_finite_on_every_rank(comm, wire_dtype):
  local = np.ones(64, np.float32)
  if comm.rank == comm.size - 1:
    local[3], local[5] = np.nan, np.inf
  fn = jax.jit(lambda g: collectives.allreduce_tree(g, comm, wire_dtype=wire_dtype))
  out = np.asarray(fn(jnp.asarray(local)))
  assert np.isnan(out[3]) and np.isposinf(out[5])
  assert np.all(np.isfinite(np.delete(out, [3, 5])))


def test_float16_wire_does_not_overflow_when_only_the_sum_exceeds_its_range(comm):
  # 40000 on every rank: the sum (40000 p) is beyond float16's 65504, the mean is not.
  # Dividing before the exchange keeps it finite, for the sum too.
  local = jnp.full((10,), 40000.0, jnp.float32)
  fn = jax.jit(lambda g: collectives.allreduce_tree(g, comm, mean=False, wire_dtype=jnp.float16))
  np.testing.assert_allclose(np.asarray(fn(local)), 40000.0 * comm.size, rtol=2e-3)


def test_buckets_follow_the_cap_in_reverse_tree_order():
  leaves = [jnp.ones(4), jnp.ones(4), jnp.ones(100), jnp.ones(4), jnp.ones(2, jnp.complex64)]
  plan = bucketing.plan_buckets(leaves, bucket_bytes=32)
  assert [b.positions for b in plan] == [(3,), (2,), (1, 0), (4,)]  # 400 B leaf alone
  half = bucketing.plan_buckets(leaves[:4], wire_dtype=np.dtype(jnp.bfloat16), bucket_bytes=16)
  assert [b.positions for b in half] == [(3,), (2,), (1, 0)]  # 2-byte wire items
  assert all(b.dtype == np.float32 for b in half)
  # A 4 MiB cap: small models stay one buffer; a leaf above it travels alone.
  small = [jnp.ones((64, 64)) for _ in range(10)]
  assert len(bucketing.plan_buckets(small, bucket_bytes=4 << 20)) == 1
  big = [jnp.ones(10), jnp.ones(2 << 20), jnp.ones(10)]
  plan = bucketing.plan_buckets(big, bucket_bytes=4 << 20)
  assert [b.positions for b in plan] == [(2,), (1,), (0,)]


def test_many_buckets_are_issued_in_one_order_on_every_rank(comm):
  # One collective per leaf, sizes all different: if ranks issued them in different
  # orders, messages would cross-match (MPI aborts with "Message truncated").
  sizes = [64, 4096, 7, 100_000, 64, 3, 2048, 512, 64, 33_333] * 3
  tree = [jnp.full((s,), float(comm.rank + 1)) for s in sizes]
  for kw in ({"bucket_bytes": 1}, {"bucket_bytes": 1, "wire_dtype": jnp.bfloat16}):
    out = jax.jit(lambda t, kw=kw: collectives.allreduce_tree(t, comm, mean=False, **kw))(tree)
    total = comm.size * (comm.size + 1) / 2
    for leaf in out:
      np.testing.assert_allclose(np.asarray(leaf), total)


@pytest.mark.parametrize("bucket_bytes", [1, 1000, 10**9])
def test_bucketed_reduction_equals_the_fused_one(comm, bucket_bytes):
  rng = np.random.default_rng(comm.rank)
  tree = {f"l{i}": jnp.asarray(rng.standard_normal((i + 1, 37)), jnp.float32) for i in range(12)}
  fused = jax.jit(lambda t: collectives.allreduce_tree(t, comm, bucket_bytes=None))(tree)
  fn = lambda t: collectives.allreduce_tree(t, comm, bucket_bytes=bucket_bytes)
  bucketed = jax.jit(fn)(tree)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(bucketed)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  n_buckets = len(bucketing.tree_buckets(tree, bucket_bytes=bucket_bytes)[1])
  calls = str(jax.make_jaxpr(fn)(tree)).count("mnjax_allreduce_sum")
  assert calls == (0 if comm.size == 1 else n_buckets)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"wire_dtype": jnp.int8}, "wire_dtype must be None .* got"),
        ({"wire_dtype": jnp.float64}, "float64 needs jax_enable_x64.*jax_enable_x64"),
        ({"wire_dtype": "fp8"}, "wire_dtype must be None"),
        ({"bucket_bytes": 0}, "bucket_bytes must be .auto.*None .* positive"),
        ({"bucket_bytes": -5}, "bucket_bytes must be .auto."),
        ({"bucket_bytes": 2.5}, "bucket_bytes must be .auto."),
        ({"bucket_bytes": True}, "bucket_bytes must be .auto."),
        ({"bucket_bytes": "big"}, "bucket_bytes must be .auto."),
    ],
)
def test_bad_options_are_refused_when_the_transformation_is_built(comm, kwargs, match):
  with pytest.raises(ValueError, match=match):
    mnjax.allreduce_gradients(comm, **kwargs)


def test_integer_or_complex_leaves_with_a_half_wire_are_refused_at_init(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm, wire_dtype=jnp.bfloat16), optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"leaf \['count'\] has dtype int32"):
    tx.init({"w": jnp.ones(3), "count": jnp.zeros((), jnp.int32)})
  with pytest.raises(TypeError, match=r"real floating-point .* leaf \['z'\] .* wire_dtype=None"):
    tx.init({"z": jnp.ones(3, jnp.complex64)})


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_a_float64_model_is_averaged_in_float64(kind):
  """ChainerMN's ``allreduce_grad_dtype=float64``: with jax_enable_x64 on, the gradients of a
  float64 model travel and are summed in float64 (steps of 2**-40, which float32 loses)."""
  with jax.enable_x64(True):
    kc = mnjax.create_communicator(kind)
    tx = optax.chain(mnjax.allreduce_gradients(kc, wire_dtype=jnp.float64), optax.sgd(1.0))
    params = {"w": jnp.zeros(3, jnp.float64)}

    def step(params, state, x):
      updates, state = tx.update({"w": jnp.broadcast_to(x[0], (3,))}, state, params)
      return optax.apply_updates(params, updates), state

    values = 1.0 + np.arange(kc.num_replicas) * 2.0**-40  # one per replica
    mine = values[kc.rank * kc.local_device_count:(kc.rank + 1) * kc.local_device_count]
    out, _ = mnjax.data_parallel(step, kc, batch_argnums=(2,))(
        params, tx.init(params), jnp.asarray(mine, jnp.float64))
    assert out["w"].dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full(3, -values.mean()))
    if kc.num_replicas > 1:  # float32 would have rounded every value to 1
      assert values.mean() != 1.0
