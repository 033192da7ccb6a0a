"""allreduce_tree, allreduce_gradients, broadcast and allreduce_metrics across ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _allreduce as collectives


def tree_for_rank(rank):
  base = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
  return {
      "w": base * (rank + 1),
      "b": jnp.full((4,), rank + 1.0, jnp.float32),
      "half": (jnp.ones((3,), jnp.bfloat16) * (rank + 1)),
  }


def count_allreduces(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return str(jaxpr).count("mnjax_allreduce_sum")


def test_allreduce_tree_mean_and_sum(comm):
  tree = tree_for_rank(comm.rank)
  total = sum(r + 1 for r in range(comm.size))  # sum over ranks of (rank + 1)
  mean = jax.jit(lambda t: collectives.allreduce_tree(t, comm))(tree)
  summed = jax.jit(lambda t: collectives.allreduce_tree(t, comm, mean=False))(tree)
  base = np.arange(6, dtype=np.float32).reshape(2, 3)
  np.testing.assert_allclose(summed["w"], base * total, rtol=1e-6)
  np.testing.assert_allclose(mean["w"], base * total / comm.size, rtol=1e-6)
  np.testing.assert_allclose(mean["b"], np.full(4, total / comm.size), rtol=1e-6)
  assert mean["half"].dtype == jnp.bfloat16
  np.testing.assert_allclose(
      np.asarray(mean["half"], np.float32), np.full(3, total / comm.size), rtol=1e-2
  )


def test_one_collective_per_wire_dtype_not_per_leaf(comm):
  tree = {f"layer{i}": jnp.ones((i + 1, 3)) for i in range(20)}
  tree["half"] = jnp.ones((5,), jnp.bfloat16)  # travels in the float32 buffer too
  calls = count_allreduces(lambda t: collectives.allreduce_tree(t, comm), tree)
  assert calls == (0 if comm.size == 1 else 1)


def test_several_wire_dtypes_are_reduced_in_one_order_on_every_rank(comm):
  tree = {
      "a": jnp.full((3,), comm.rank + 1.0, jnp.float32),
      "z": jnp.full((2,), (comm.rank + 1) * (1 + 1j), jnp.complex64),
      "b": jnp.full((4,), 2.0 * (comm.rank + 1), jnp.float32),
  }
  fn = lambda t: collectives.allreduce_tree(t, comm, mean=False)
  out = jax.jit(fn)(tree)
  total = comm.size * (comm.size + 1) / 2
  np.testing.assert_allclose(out["a"], np.full(3, total))
  np.testing.assert_allclose(out["b"], np.full(4, 2 * total))
  np.testing.assert_allclose(out["z"], np.full(2, total * (1 + 1j)))
  assert count_allreduces(fn, tree) == (0 if comm.size == 1 else 2)  # one per wire dtype


def test_in_step_and_host_traffic_use_separate_communicators(comm):
  assert comm.device_comm != comm.mpi_comm
  assert comm.device_comm.size == comm.mpi_comm.size == comm.size
  # A host collective issued while an asynchronously dispatched step still reduces
  # gradients must not be matched with it: both complete, with the right values.
  x = jnp.full((200_000,), comm.rank + 1.0)
  pending = jax.jit(lambda v: collectives.allreduce_tree(v, comm, mean=False))(x)
  host = mnjax.allreduce_metrics({"n": comm.rank + 1}, comm)
  total = comm.size * (comm.size + 1) // 2
  assert host["n"] == total
  np.testing.assert_allclose(np.asarray(pending)[:3], np.full(3, float(total)))


def test_allreduce_gradients_in_a_user_jitted_step(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(1.0))
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x = jnp.full(3, float(comm.rank))  # local gradient = rank
  params, state = step(params, state, x)
  expected = -np.mean(np.arange(comm.size))
  np.testing.assert_allclose(params["w"], np.full(3, expected), rtol=1e-6)


def test_broadcast_gives_roots_tree_to_everyone(comm):
  root = comm.size - 1
  tree = {
      "f": jnp.full((2, 2), float(comm.rank)),
      "bf16": jnp.full((3,), comm.rank, jnp.bfloat16),
      "i": np.full((2,), comm.rank, np.int32),
      "step": jnp.asarray(comm.rank),
  }
  out = mnjax.broadcast(tree, comm, root=root)
  np.testing.assert_array_equal(out["f"], np.full((2, 2), float(root)))
  np.testing.assert_array_equal(np.asarray(out["bf16"], np.float32), np.full(3, float(root)))
  np.testing.assert_array_equal(out["i"], np.full(2, root))
  assert isinstance(out["f"], jax.Array) and isinstance(out["i"], np.ndarray)
  assert out["bf16"].dtype == jnp.bfloat16 and int(out["step"]) == root


def test_broadcast_shape_mismatch_raises_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip("a mismatch between ranks needs >= 2 ranks (runs under mpirun)")
  shape = (3,) if comm.rank == comm.size - 1 else (2,)
  with pytest.raises(ValueError, match=rf"rank {comm.size - 1} leaf \['w'\] \(3,\)"):
    mnjax.broadcast({"w": np.zeros(shape, np.float32)}, comm)
  # Nothing was left half-transferred: the next collective still lines up.
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_allreduce_metrics_exact_integers_and_float_sums(comm):
  local = {"correct": np.int32(comm.rank + 1), "count": 10, "loss_sum": 0.5,
           "hist": np.arange(3) * comm.rank}
  out = mnjax.allreduce_metrics(local, comm)
  assert out["correct"] == comm.size * (comm.size + 1) // 2
  assert out["count"] == 10 * comm.size and out["count"].dtype == np.int64
  assert out["loss_sum"] == pytest.approx(0.5 * comm.size)
  np.testing.assert_array_equal(out["hist"], np.arange(3) * sum(range(comm.size)))
  assert mnjax.train.global_mean(out)["loss"] == pytest.approx(0.05)


def test_in_step_allreduce_refuses_differentiation_with_a_clear_error(comm):
  from mnjax.comm._instep._primitives import allreduce_sum

  with pytest.raises(NotImplementedError, match="reduce gradients after jax.grad"):
    jax.grad(lambda v: allreduce_sum(v, comm.device_comm).sum())(jnp.ones(3))


def test_broadcast_refuses_different_roots_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip("different roots need >= 2 ranks (runs under mpirun)")
  # Before: a hang with a big tree, or rank 1 silently holding rank 0's data.
  root = 1 if comm.rank == 1 else 0
  listed = ", ".join(f"rank {r} root={1 if r == 1 else 0}" for r in range(comm.size))
  with pytest.raises(ValueError, match=rf"broadcast: every rank must pass the same root, but"
                                       rf" {listed}\."):
    mnjax.broadcast({"w": np.full(3, float(comm.rank))}, comm, root=root)
  # A root out of range on one rank only is the same disagreement, not a hang.
  with pytest.raises(ValueError, match=r"every rank must pass the same root, .*root=7"):
    mnjax.broadcast({"w": np.zeros(3)}, comm, root=7 if comm.rank == comm.size - 1 else 0)
  with pytest.raises(ValueError, match=r"root must be a rank in \[0, "):
    mnjax.broadcast({"w": np.zeros(3)}, comm, root=comm.size)  # the same bad root everywhere
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_broadcast_refuses_a_list_on_one_rank_and_a_tuple_on_another(comm):
  if comm.size == 1:
    pytest.skip("a mismatch between ranks needs >= 2 ranks (runs under mpirun)")
  last = comm.rank == comm.size - 1
  tree = {"layers": (np.zeros(2), np.ones(2)) if last else [np.zeros(2), np.ones(2)]}
  with pytest.raises(ValueError, match=rf"rank {comm.size - 1} has a tuple at \['layers'\]"
                                       r" where rank 0 has a list"):
    mnjax.broadcast(tree, comm)
  with pytest.raises(ValueError, match=r"allreduce_metrics: .*tuple at \['pair'\]"):
    mnjax.allreduce_metrics({"pair": (1, 2) if last else [1, 2]}, comm)
  with pytest.raises(ValueError, match=r"mean_metrics: .*tuple at \['pair'\]"):
    mnjax.mean_metrics({"pair": (1.0, 2.0) if last else [1.0, 2.0]}, comm)
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_a_python_float_gradient_leaf_is_judged_alike_at_init_and_in_jit(comm):
  # Before: refused at init ("integer leaves"), accepted inside jit.
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(1.0))
  params = {"w": jnp.ones(2), "scale": 0.5}
  state = tx.init(params)  # float32 under jit, so accepted here too
  updates, _ = jax.jit(tx.update)({"w": jnp.ones(2), "scale": 0.25}, state, params)
  assert float(updates["scale"]) == pytest.approx(-0.25)
  for leaf, came in [(3, r"dtype int32 \(a Python int, 3\)"),
                     ("x", r"no dtype \(a str, 'x'\)")]:
    with pytest.raises(TypeError, match=rf"leaf \['n'\] has {came}\. Only arrays of floats"):
      tx.init({"n": leaf})
  with pytest.raises(TypeError, match=r"leaf \['n'\] has dtype int32\. Only arrays of floats"):
    jax.jit(mnjax.allreduce_gradients(comm).update)({"n": 3}, optax.EmptyState())
