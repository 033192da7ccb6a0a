"""shard_optimizer (ZeRO-1): the same training as allreduce_gradients + tx, replicas bitwise
identical, 1/P of the optimizer state per rank, checkpoints that resume on another number of
ranks, and whole-tree transformations refused (or, for global-norm clipping, exact).

Exactness, stated once: the gradient each rank's share receives is the sum of the ranks'
rows in rank order. On 1 and 2 ranks that is the value MPI's allreduce gives (a + b is
commutative); on 3 or more MPI may associate the sum differently. And the same formulas run
on other shapes and in other fusions: the gradients feed a pad-and-reshape instead of the
allreduce's packing, tx runs on 1-D shares instead of the leaves' shapes, and XLA:CPU then
emits other code for the same elementwise formulas (vector or scalar loops; measured: adam
in one process, 2-D leaf vs its raveled copy, differs in the last bit from the second
step). So against ``chain(allreduce_gradients, tx)`` the comparison is to 1e-6 relative
+ 1e-7 absolute, not bitwise (measured, elementwise: up to 2.8e-7 relative for adam, 1.6e-6
for sgd with momentum on an element near zero, 3 ranks); against one process running tx on the
global batch's mean gradient, 1e-5 relative (the issue's bound). Replicas: bitwise
identical, always.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _scatter as scatter
from mnjax.optim import _shard_state as shard

STEPS, PER_RANK = 10, 6
# Leaf sizes 35, 5, 1 and 11: none divisible by 2 or 3 (shares end in padding).
SHAPES = {"w": (7, 5), "b": (5,), "scale": (), "v": (11,)}


def init_params():
  rng = np.random.default_rng(1)
  return {k: jnp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}


def loss(params, x):
  h = jnp.tanh(x[:, :7] @ params["w"] + params["b"]) * params["scale"]
  return jnp.mean((h.sum(-1) - x[:, 7]) ** 2) + jnp.mean((x[:, :11] - params["v"]) ** 2)


def batches(size, steps=STEPS):
  """Every rank's batch of every step, (steps, size * PER_RANK, 12): a global batch."""
  rng = np.random.default_rng(2)
  return rng.standard_normal((steps, size * PER_RANK, 12)).astype(np.float32)


def train(tx, comm, data, params=None, state=None):
  """`len(data)` steps of `tx` on this rank's part of each global batch."""
  params = init_params() if params is None else params
  state = tx.init(params) if state is None else state

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  per = data.shape[1] // comm.size
  for x in data:
    params, state = step(params, state, x[comm.rank * per:(comm.rank + 1) * per])
  return params, state


def single_process(tx, data, params=None):
  """tx on the mean gradient of each whole global batch, in this process (the reference)."""
  params = init_params() if params is None else params
  state = tx.init(params)
  for x in data:
    grads = jax.grad(loss)(params, x)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def same_on_every_rank(comm, tree):
  mine = b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(tree))
  return len(set(comm.mpi_comm.allgather(mine))) == 1


def assert_equal(a, b, *, rtol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol * 0.1)


DECAY_MASK = {"w": True, "b": False, "scale": False, "v": True}
OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=DECAY_MASK),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_equals_allreduce_chain_and_single_process(comm, name):
  data = batches(comm.size)
  sharded, state = train(mnjax.shard_optimizer(OPTIMIZERS[name](), comm), comm, data)
  chained, _ = train(optax.chain(mnjax.allreduce_gradients(comm), OPTIMIZERS[name]()), comm,
                     data)
  assert_equal(sharded, chained, rtol=1e-6)  # not bitwise: module docstring
  reference, ref_state = single_process(OPTIMIZERS[name](), data)
  assert_equal(sharded, reference, rtol=1e-5)
  assert same_on_every_rank(comm, sharded)
  # The moments, joined from every rank's shares, are the unsharded ones.
  full = mnjax.optim.gather_optimizer_state(comm, OPTIMIZERS[name](), state, sharded)
  assert jax.tree.structure(full) == jax.tree.structure(ref_state)
  for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(x, np.asarray(y), rtol=1e-5, atol=1e-6)


def test_each_rank_holds_its_share_of_every_moment(comm):
  params = init_params()
  full = optax.adam(1e-3).init(params)
  state = mnjax.shard_optimizer(optax.adam(1e-3), comm).init(params)
  mu, nu = state.inner[0].mu, state.inner[0].nu
  for k, s in SHAPES.items():
    n = int(np.prod(s))
    assert mu[k].shape == nu[k].shape == (-(-n // comm.size),)  # ceil(n / P) elements
  nbytes = lambda tree: sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
  moments = sum(-(-int(np.prod(s)) // comm.size) for s in SHAPES.values()) * 4 * 2
  assert nbytes(state) == moments + 4  # plus the int32 step count
  assert nbytes(state) <= nbytes(full) / comm.size + 2 * 4 * len(SHAPES) * comm.size + 4


def test_sixteen_bit_wire_within_its_bound(comm):
  rng = np.random.default_rng(3)
  every = rng.standard_normal((comm.size, 35)).astype(np.float32) * 10
  grads = {"w": jnp.asarray(every[comm.rank].reshape(7, 5))}
  tx = mnjax.shard_optimizer(optax.sgd(1.0), comm, wire_dtype=jnp.bfloat16)
  params = {"w": jnp.zeros((7, 5))}
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  got = -np.asarray(updates["w"]).ravel()
  bound = mnjax.comm.error_bound(np.abs(every).sum(0), comm.num_replicas, jnp.bfloat16)
  assert np.all(np.abs(got - every.mean(0)) <= bound)
  assert same_on_every_rank(comm, updates)


@pytest.mark.parametrize("max_norm", [1e-2, 1e3])  # clipping active, and not
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_clip_global_norm_equals_optax_clipping_before_tx(comm, max_norm):
  data = batches(comm.size, steps=4)
  sharded, _ = train(mnjax.shard_optimizer(optax.adam(1e-2), comm, clip_global_norm=max_norm),
                     comm, data)
  reference, _ = single_process(
      optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(1e-2)), data)
  assert_equal(sharded, reference, rtol=1e-5)
  assert same_on_every_rank(comm, sharded)


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_checkpoint_resumes_bitwise_on_the_same_ranks(comm):
  tx = optax.adam(1e-2)
  sharded = mnjax.shard_optimizer(tx, comm)
  data = batches(comm.size)
  whole, whole_state = train(sharded, comm, data)
  params, state = train(sharded, comm, data[:4])
  directory = comm.mpi_comm.bcast(tempfile.mkdtemp() if comm.is_root else None, root=0)
  ckpt = mnjax.Checkpointer(directory, comm, async_save=False)
  ckpt.save(4, {"params": params,
                "opt": mnjax.optim.gather_optimizer_state(comm, tx, state, params)})
  fresh = init_params()
  template = {"params": fresh, "opt": mnjax.optim.gather_optimizer_state(
      comm, tx, sharded.init(fresh), fresh)}
  step, restored, _ = ckpt.restore(template)
  ckpt.close()
  assert step == 4
  state = mnjax.optim.scatter_optimizer_state(comm, tx, restored["opt"], restored["params"])
  params, state = train(sharded, comm, data[4:], restored["params"], state)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((whole, whole_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def two_sizes(comm, order):
  """``(world, colour, first, second)``: the job's communicators of P and P - 1 ranks (the
  last rank alone, colour 1, on a size-1 one), in the order "fewer" (P, then P - 1) or
  "more"; skips with one rank."""
  if comm.size == 1:
    pytest.skip("needs two ranks or more (runs under mpirun)")
  world = comm.mpi_comm
  colour = int(comm.rank == comm.size - 1)
  part = mnjax.create_communicator("flat", world.Split(colour, key=comm.rank))
  return (world, colour, *((comm, part) if order == "fewer" else (part, comm)))


@pytest.mark.parametrize("order", ["fewer", "more"])
def test_checkpoint_resumes_on_another_number_of_ranks(comm, order):
  # Save on all ranks and resume on all but the last ("fewer"), or the reverse ("more"); the
  # last rank sits alone on a size-1 communicator meanwhile. 6 rows per rank divide evenly.
  world, colour, first, second = two_sizes(comm, order)
  tx = optax.adam(1e-2)
  data = batches(comm.size)  # 6 rows per rank: divisible by 1, 2 (and 3 ranks of 4)
  reference, ref_state = single_process(tx, data)
  directory = world.bcast(tempfile.mkdtemp() if comm.is_root else None, root=0)
  if colour == 0 or first is comm:
    params, state = train(mnjax.shard_optimizer(tx, first), first, data[:5])
    ckpt = mnjax.Checkpointer(directory, first, async_save=False)
    ckpt.save(5, {"params": params,
                  "opt": mnjax.optim.gather_optimizer_state(first, tx, state, params)})
    ckpt.close()
  world.Barrier()
  if colour == 0 or second is comm:
    sharded = mnjax.shard_optimizer(tx, second)
    fresh = init_params()
    template = {"params": fresh, "opt": mnjax.optim.gather_optimizer_state(
        second, tx, sharded.init(fresh), fresh)}
    ckpt = mnjax.Checkpointer(directory, second, async_save=False)
    _, restored, _ = ckpt.restore(template)
    ckpt.close()
    state = mnjax.optim.scatter_optimizer_state(second, tx, restored["opt"], restored["params"])
    assert state.parts == second.size
    params, state = train(sharded, second, data[5:], restored["params"], state)
    assert_equal(params, reference, rtol=1e-5)
    full = mnjax.optim.gather_optimizer_state(second, tx, state, params)
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(ref_state)):
      np.testing.assert_allclose(x, np.asarray(y), rtol=1e-5, atol=1e-6)
    assert same_on_every_rank(second, params)
  world.Barrier()


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_resharding_for_any_number_of_ranks_is_lossless():
  tx = optax.adam(1e-2)
  params = dict(init_params(), one=jnp.ones(1))  # a leaf whose share has its own shape
  full = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)[1]
  for parts in (1, 2, 3, 4, 7):
    inners = [shard.cut_shares(tx, full, params, i, parts) for i in range(parts)]
    assert [s[0].mu["one"].tolist() for s in inners] == [[np.float32(0.1)]] + [[0.0]] * (parts - 1)
    again = shard.join_shares(tx, inners, params)
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(full)):
      np.testing.assert_array_equal(x, np.asarray(y))


# A raw ShardedState in a Checkpointer's tree (saved whole, restored re-sharded on any number
# of ranks): tests/distributed/test_shard_checkpoint.py.


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("tx, name", [
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
     "clip_by_global_norm.*clip_global_norm="),
    (lambda: optax.lamb(1e-3), "scale_by_trust_ratio"),
    (lambda: optax.lars(1e-3), "scale_by_trust_ratio"),
    (lambda: optax.adafactor(1e-3), "scale_by_factored_rms"),
    (lambda: optax.apply_if_finite(optax.adam(1e-3), 3), "apply_if_finite.*wrap"),
])
def test_whole_tree_transformations_are_refused_at_construction(comm, tx, name):
  with pytest.raises(ValueError, match=name):
    mnjax.shard_optimizer(tx(), comm)


def test_a_transformation_the_names_miss_is_refused_by_the_probe(comm):
  def scale_by_mean_square():  # a home-made norm-based transformation
    def update(updates, state, params=None):
      norm = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(updates))
      return jax.tree.map(lambda x: x / (1.0 + norm), updates), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  shape_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  for tx in (scale_by_mean_square(), optax.adamw(1e-3, mask=shape_mask)):
    sharded = mnjax.shard_optimizer(tx, comm)  # no known name: accepted here
    with pytest.raises(ValueError, match="not elementwise"):
      sharded.init(init_params())
  # The mask given as a pytree of bools is elementwise, and accepted.
  mask = jax.tree.map(lambda x: x.ndim > 1, init_params())
  mnjax.shard_optimizer(optax.adamw(1e-3, mask=mask), comm).init(init_params())


def test_bad_arguments_are_refused(comm):
  with pytest.raises(TypeError, match="Communicator"):
    mnjax.shard_optimizer(optax.adam(1e-3), None)
  with pytest.raises(TypeError, match="GradientTransformation"):
    mnjax.shard_optimizer("adam", comm)
  with pytest.raises(TypeError, match=r"comes first.*shard_optimizer\(tx, comm\)"):
    mnjax.shard_optimizer(comm, optax.adam(1e-3))  # arguments swapped
  with pytest.raises(ValueError, match="allreduce_gradients"):
    mnjax.shard_optimizer(optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1)), comm)
  with pytest.raises(ValueError, match="clip_global_norm"):
    mnjax.shard_optimizer(optax.adam(1e-3), comm, clip_global_norm=-1.0)
  with pytest.raises(ValueError, match="wire_dtype"):
    mnjax.shard_optimizer(optax.adam(1e-3), comm, wire_dtype=jnp.int8)
  with pytest.raises(TypeError, match=r"leaf \['step'\]"):
    mnjax.shard_optimizer(optax.adam(1e-3), comm).init({"w": jnp.ones(3),
                                                        "step": jnp.zeros((), jnp.int32)})


def test_multi_device_kinds_are_refused_at_construction():
  comm = mnjax.create_communicator("hierarchical")
  with pytest.raises(ValueError, match="'hierarchical' is not supported.*flat"):
    mnjax.shard_optimizer(optax.adam(1e-3), comm)


def test_a_state_of_another_sharding_is_refused_when_traced(comm):
  tx = mnjax.shard_optimizer(optax.adam(1e-3), comm)
  params = init_params()
  state = tx.init(params)
  other = shard.ShardedState(state.inner, comm.rank, comm.size + 1)
  with pytest.raises(ValueError, match=f"share {comm.rank} of {comm.size + 1}"):
    jax.jit(tx.update)(params, other, params)
  with pytest.raises(ValueError, match="not a whole state"):
    mnjax.optim.scatter_optimizer_state(comm, optax.adam(1e-3), state.inner, params)


def test_shares_and_wire_helpers_round_trip():
  x = jnp.arange(11.0).reshape(11)
  for parts in (1, 2, 3, 4):
    rows = np.stack([np.asarray(scatter.shard_leaf(x, r, parts)) for r in range(parts)])
    assert rows.shape == (parts, -(-11 // parts))
    np.testing.assert_array_equal(scatter.unshard_leaf(rows, (11,)), np.asarray(x))



def test_ranks_that_trace_different_trees_are_stopped_before_any_exchange(comm):
  if comm.size == 1:
    pytest.skip("needs two ranks or more (runs under mpirun)")
  tx = mnjax.shard_optimizer(optax.adam(1e-3), comm, preflight_timeout=60)
  params = {"w": jnp.ones((4, 3))}
  state = tx.init(params)
  shape = (3, 4) if comm.rank == comm.size - 1 else (4, 3)  # same size: MPI would not notice
  grads = {"w": jnp.ones(shape)}
  with pytest.raises(ValueError, match="disagree"):
    jax.jit(tx.update)(grads, state, params)


def test_small_buckets_and_half_precision_leaves(comm):
  # bucket_bytes=64: several buckets per exchange; a bfloat16 leaf is summed in float32 and
  # all-gathered as 16-bit words.
  params = {"a": jnp.ones((5, 3)), "h": jnp.ones(9, jnp.bfloat16), "z": jnp.zeros(13)}
  rng = np.random.default_rng(4)
  every = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
           for _ in range(comm.size)]
  results = []
  for tx in (mnjax.shard_optimizer(optax.sgd(0.1, momentum=0.9), comm, bucket_bytes=64),
             optax.chain(mnjax.allreduce_gradients(comm, bucket_bytes=64),
                         optax.sgd(0.1, momentum=0.9))):
    p, s = params, tx.init(params)
    for _ in range(3):
      u, s = jax.jit(tx.update)(every[comm.rank], s, p)
      p = optax.apply_updates(p, u)
    results.append(p)
  assert results[0]["h"].dtype == jnp.bfloat16
  assert same_on_every_rank(comm, results[0])
  for k in params:
    rtol = 1e-2 if k == "h" else 1e-6  # bfloat16: within one unit in the last place
    np.testing.assert_allclose(np.asarray(results[0][k], np.float32),
                               np.asarray(results[1][k], np.float32), rtol=rtol, atol=rtol * 0.1)


def test_a_nonfinite_gradient_on_one_rank_is_skipped_by_every_rank(comm):
  # skip_nonfinite around the sharded optimizer decides on the all-gathered update, the same
  # on every rank; a NaN in the last rank's batch of step 4 reaches it through the exchange.
  tx = mnjax.skip_nonfinite(mnjax.shard_optimizer(optax.adam(1e-2), comm), on="update")
  data = batches(comm.size)
  data[4, -1, 0] = np.nan  # the last rank's last example
  params, state = train(tx, comm, data)
  assert int(state.skipped) == 1 and same_on_every_rank(comm, params)
  clean = np.delete(batches(comm.size), 4, axis=0)  # the same run without step 4
  want, _ = single_process(optax.adam(1e-2), clean)
  assert_equal(params, want, rtol=1e-5)


def test_deciding_on_each_ranks_own_gradient_is_refused(comm):
  with pytest.raises(ValueError, match=r"is sharded .* ranks would skip different steps.*"
                                       r"on='update'"):
    mnjax.skip_nonfinite(mnjax.shard_optimizer(optax.adam(1e-2), comm)).init(init_params())


def home_made_clip(max_norm):
  """optax's global-norm clip as a user writes it, under a name no list knows."""
  def update_fn(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm),
                        updates), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


@pytest.mark.parametrize("max_norm", [1e4, 1e8, 1e12])
@pytest.mark.parametrize("after", ["sgd", "adam"])
def test_a_home_made_global_norm_clip_is_refused_above_the_old_probes_range(comm, max_norm,
                                                                          after):
  # The probe's first pair of gradients (1e3, then 1e-2) stays under these thresholds, so a
  # clip there never acts; each share would then be clipped by its own norm once training
  # gradients cross it. The probe's second pair (1e15, then 1e14) crosses it.
  tx = optax.chain(home_made_clip(max_norm),
                   optax.sgd(0.1) if after == "sgd" else optax.adam(1e-2))
  sharded = mnjax.shard_optimizer(tx, comm)  # no known name: accepted here
  with pytest.raises(ValueError, match=r"not elementwise.*clip_global_norm="):
    sharded.init(init_params())


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_elementwise_optimizers_still_pass_the_probe_with_huge_gradients(comm):
  for tx in (optax.sgd(0.1, momentum=0.9), optax.adam(1e-2), optax.rmsprop(1e-3),
             optax.lion(1e-4), optax.adamw(1e-2, weight_decay=0.1)):
    mnjax.shard_optimizer(tx, comm).init(init_params())
  bf16 = {"w": jnp.ones((4, 3), jnp.bfloat16), "h": jnp.ones(5, jnp.float16)}
  mnjax.shard_optimizer(optax.adam(1e-2), comm).init(bf16)


def test_broadcast_and_check_replicas_of_a_sharded_state_say_what_to_do(comm):
  """Each rank holds its own share by design: the advice for trees that should be equal
  ("build the tree the same way", "restore the last checkpoint") is not the fix."""
  tx = mnjax.shard_optimizer(optax.adam(1e-2), comm)
  params = init_params()
  state = {"params": params, "opt": tx.init(params)}
  where = rf"\['opt'\]\.shard_{comm.rank}_of_{comm.size}"
  with pytest.raises(ValueError, match=rf"(?s)broadcast: .*shard_optimizer.*at {where}.*"
                                       r"different on every rank by design.*"
                                       r"broadcast\(params, comm\).*tx\.init\(params\)"):
    mnjax.broadcast(state, comm)
  with pytest.raises(ValueError, match=rf"(?s)check_replicas: .*shard_optimizer.*at {where}.*"
                                       r"by design.*check_replicas\(params, comm\)"):
    mnjax.check_replicas(state, comm)
  # What is replicated still is: broadcast and compared as usual.
  assert same_on_every_rank(comm, mnjax.broadcast(params, comm))
  mnjax.check_replicas(params, comm)
