"""Ranks must run the same program (mnjax/guard/_program.py, through data_parallel and the
transformations): one changed hyperparameter, accumulation period or constant on one rank
is named on every rank before any collective; leftover pmap collectives are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _native as native

KINDS = ["flat", "hierarchical"]


def odd(comm, usual, other):
  """`other` on the last rank, `usual` elsewhere: the mutation."""
  return other if comm.rank == comm.size - 1 else usual


def needs_ranks(comm):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")


def train_step(tx):
  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def run(comm, tx, kind_comm=None, *, check_program=True, x=None):
  c = kind_comm or comm
  params = {"w": jnp.ones((3, 2))}
  step = mnjax.data_parallel(train_step(tx), c, batch_argnums=(2,),
                             check_program=check_program)
  x = jnp.ones((2 * c.local_device_count, 3)) if x is None else x
  return step(params, tx.init(params), x)


def raises_everywhere(comm, fn, match):
  """`fn()` raises a ValueError matching `match`, the same text on every rank, and no
  allreduce completed on any rank."""
  before = native.allreduce_calls()
  with pytest.raises(ValueError, match=match) as info:
    fn()
  assert native.allreduce_calls() == before
  assert len(set(comm.mpi_comm.allgather(str(info.value)))) == 1
  return str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_another_learning_rate_on_one_rank_is_named(comm, kind):
  needs_ranks(comm)
  c = mnjax.create_communicator(kind)
  tx = optax.chain(mnjax.allreduce_gradients(c), optax.adam(odd(comm, 1e-2, 1e-1)))
  last = comm.size - 1
  message = raises_everywhere(
      comm, lambda: run(comm, tx, c),
      rf"literal -0.01:f32\[\] on rank 0, literal -0.1:f32\[\] on rank {last}")
  assert "ranks traced different programs" in message
  assert "optax/_src/transform.py" in message  # where it comes from: the rate's scale


@pytest.mark.parametrize("kind", KINDS)
def test_another_accumulation_period_on_one_rank_is_named(comm, kind):
  needs_ranks(comm)
  c = mnjax.create_communicator(kind)
  tx = mnjax.accumulate_gradients(
      optax.chain(mnjax.allreduce_gradients(c), optax.sgd(0.1)), every_k=odd(comm, 2, 3))
  raises_everywhere(comm, lambda: run(comm, tx, c),
                    r"accumulate_gradients.*every_k.*3.*2|every_k.*2.*3")


def test_another_accumulation_period_is_named_in_a_plain_jit_step(comm):
  needs_ranks(comm)  # no data_parallel: the allreduce's own pre-flight check sees it
  tx = mnjax.accumulate_gradients(
      optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)), every_k=odd(comm, 4, 2))
  params = {"w": jnp.ones((3, 2))}
  raises_everywhere(comm, lambda: jax.jit(train_step(tx))(params, tx.init(params),
                                                          jnp.ones((2, 3))),
                    r"enclosing transformations is .*every_k")


def test_another_constant_on_one_rank_is_named(comm):
  needs_ranks(comm)
  decay = jnp.full((3, 2), odd(comm, 1e-4, 2e-4))  # closed over: a constant of the step
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1))

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    grads = {"w": grads["w"] + decay * params["w"]}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {"w": jnp.ones((3, 2))}
  message = raises_everywhere(
      comm, lambda: mnjax.data_parallel(step, comm, batch_argnums=(2,))(
          params, tx.init(params), jnp.ones((2, 3))), r"`constant`")
  assert "0.0001" in message and "0.0002" in message  # both values, shown


def test_shard_optimizer_with_another_inner_rate_is_named_in_a_plain_jit_step(comm):
  needs_ranks(comm)
  tx = mnjax.shard_optimizer(optax.adam(odd(comm, 1e-2, 1e-1)), comm)
  params = {"w": jnp.ones((3, 2))}
  message = raises_everywhere(
      comm, lambda: jax.jit(train_step(tx))(params, tx.init(params), jnp.ones((2, 3))),
      r"shard_optimizer: the ranks traced different programs for the update of the"
      r" optimizer it shards")
  assert f"literal -0.1:f32[] on rank {comm.size - 1}" in message


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_program_runs_and_per_rank_values_go_in_as_arguments(comm, kind):
  c = mnjax.create_communicator(kind)
  tx = optax.chain(mnjax.allreduce_gradients(c), optax.sgd(0.1))
  # The batch differs per rank by value: arguments are compared by shape and dtype only.
  x = jnp.full((2 * c.local_device_count, 3), 1.0 + comm.rank)
  params, _ = run(comm, tx, c, x=x)
  everyone = comm.mpi_comm.allgather(np.asarray(params["w"]))
  assert all(np.array_equal(w, everyone[0]) for w in everyone)


def test_check_program_false_lets_a_rank_dependent_program_run(comm):
  needs_ranks(comm)
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(odd(comm, 0.1, 0.2)))
  params, _ = run(comm, tx, check_program=False)
  everyone = comm.mpi_comm.allgather(np.asarray(params["w"]))
  assert not np.array_equal(everyone[0], everyone[-1])  # what the check prevents


def test_a_retrace_on_one_rank_only_needs_no_round(comm):
  # A forward-only step (no gradient exchange): after the first call has been agreed on,
  # rank 0 alone calls it with another batch size; it must not wait for the others.
  step = mnjax.data_parallel(lambda w, x: jnp.sum(x @ w), comm, batch_argnums=(1,))
  w = jnp.ones((3,))
  step(w, jnp.ones((4, 3)))
  if comm.rank == 0:
    assert float(step(w, jnp.ones((2, 3)))) == 6.0
  comm.mpi_comm.Barrier()


def test_a_leftover_pmean_under_flat_is_refused_with_the_fix_unless_marked_local(comm):
  step = mnjax.data_parallel(lambda x: jax.lax.pmean(x, comm.axis_name), comm,
                             batch_argnums=(0,))
  with pytest.raises(ValueError, match=r"mnjax.comm.allreduce_tree\(x, comm\).*process_local"):
    step(jnp.ones(2))

  def local(x):  # this process's one device, on purpose: as under the multi-device kinds
    with mnjax.process_local():
      return jax.lax.pmean(x, comm.axis_name), jax.lax.axis_index(comm.axis_name)

  x = jnp.arange(2.0) + comm.rank
  mean, index = mnjax.data_parallel(local, comm, batch_argnums=(0,))(x)
  assert mean.tolist() == x.tolist() and int(index) == 0


@pytest.mark.parametrize("kind", ["hierarchical", "two_dimensional"])
def test_a_leftover_pmean_under_the_local_kinds_is_refused_unless_marked_local(comm, kind):
  c = mnjax.create_communicator(kind)
  x = jnp.arange(float(c.local_device_count))
  step = mnjax.data_parallel(lambda x: jax.lax.pmean(x, c.axis_name), c, batch_argnums=(0,))
  with pytest.raises(ValueError, match=r"pmean|psum.*silently local|process_local"):
    step(x)

  def local(x):
    with mnjax.process_local():
      return jax.lax.pmean(x, c.axis_name)

  assert float(mnjax.data_parallel(local, c, batch_argnums=(0,))(x)[0]) == float(x.mean())


def test_flax_batch_norm_over_the_axis_is_refused_under_hierarchical(comm):
  import flax.linen as nn
  c = mnjax.create_communicator("hierarchical")
  model = nn.BatchNorm(use_running_average=False, axis_name=c.axis_name)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((2, 4))))
  variables = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), variables)

  def step(v, x):
    y, _ = model.apply(v, x, mutable=["batch_stats"])
    return y.sum()

  with pytest.raises(ValueError, match=r"flax/linen/normalization.py"):
    mnjax.data_parallel(step, c, batch_argnums=(1,))(variables,
                                                     jnp.ones((2 * c.local_device_count, 4)))


def test_mnjax_own_collectives_are_not_refused(comm):
  c = mnjax.create_communicator("hierarchical")
  step = mnjax.data_parallel(lambda x: mnjax.comm.allreduce_tree(x.sum(), c, mean=False), c,
                             batch_argnums=(0,))
  assert float(step(jnp.ones(2 * c.local_device_count))) == 2.0 * c.num_replicas


def test_a_rank_dependent_scope_is_compared_by_shapes_only(comm):
  def step(x):
    with mnjax.guard.rank_dependent():
      return x * (1.0 + comm.rank)

  got = mnjax.data_parallel(step, comm, batch_argnums=())(jnp.ones(()))
  assert float(got) == 1.0 + comm.rank


def test_shard_optimizer_under_data_parallel_runs(comm):
  # Each rank slices its own share: allowed (rank_dependent), the rest still compared.
  tx = mnjax.shard_optimizer(optax.adam(1e-2), comm)
  params, _ = run(comm, tx)
  everyone = comm.mpi_comm.allgather(np.asarray(params["w"]))
  assert all(np.array_equal(w, everyone[0]) for w in everyone)


@pytest.mark.parametrize("kind", ["hierarchical", "two_dimensional"])
def test_a_per_device_output_not_listed_is_refused(comm, kind):
  c = mnjax.create_communicator(kind)
  x = jnp.arange(2.0 * c.local_device_count)

  def step(w, x):  # a per-device loss returned as if it were replicated
    return w + mnjax.comm.allreduce_tree(x.sum(), c), jnp.sum(x * w)

  with pytest.raises(ValueError, match=r"output leaf.*\[1\].*per_device_outputs"):
    mnjax.data_parallel(step, c, batch_argnums=(1,))(jnp.ones(()), x)
  w, loss = mnjax.data_parallel(step, c, batch_argnums=(1,), per_device_outputs=(1,))(
      jnp.ones(()), x)
  assert loss.shape == (c.local_device_count,)
