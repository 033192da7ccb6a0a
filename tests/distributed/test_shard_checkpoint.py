"""Checkpointer with shard_optimizer's state in the tree: saved whole (the unsharded state,
whatever the number of ranks), restored bitwise on the same ranks, re-sharded on another
number of ranks (a sub-communicator of this job), and refused clearly on every rank when the
sharding does not match the communicator."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_checkpointer import damage
from test_shard import (
    assert_equal,
    batches,
    init_params,
    same_on_every_rank,
    single_process,
    train,
    two_sizes,
)

import mnjax
from mnjax.optim import _shard_state as shard

TX = lambda: optax.adam(1e-2)


def assert_bitwise(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_raw_sharded_state_resumes_bitwise_on_the_same_ranks(comm, tmp_path):
  sharded = mnjax.shard_optimizer(TX(), comm)
  data = batches(comm.size)
  whole, whole_state = train(sharded, comm, data)
  params, state = train(sharded, comm, data[:4])
  ckpt = mnjax.Checkpointer(tmp_path, comm, async_save=False)
  ckpt.save(4, {"params": params, "opt": state})
  fresh = init_params()
  step, restored, _ = ckpt.restore({"params": fresh, "opt": sharded.init(fresh)})
  ckpt.close()
  assert step == 4
  assert (restored["opt"].index, restored["opt"].parts) == (comm.rank, comm.size)
  assert_bitwise(restored, {"params": params, "opt": state})  # this rank's own shares
  params, state = train(sharded, comm, data[4:], restored["params"], restored["opt"])
  assert_bitwise((params, state), (whole, whole_state))


def test_on_disk_tree_is_the_unsharded_state(comm, tmp_path):
  # Restored into an unsharded template, the checkpoint is gather_optimizer_state's tree, bit
  # for bit, and it verified against the digests saved with it (restore checks them).
  tx = TX()
  params, state = train(mnjax.shard_optimizer(tx, comm), comm, batches(comm.size, steps=3))
  full = mnjax.optim.gather_optimizer_state(comm, tx, state, params)
  directory = tmp_path
  with mnjax.Checkpointer(directory, comm) as ckpt:  # asynchronous, the default
    ckpt.save(3, {"params": params, "opt": state})
  ckpt = mnjax.Checkpointer(directory, comm)
  fresh = init_params()
  _, restored, _ = ckpt.restore({"params": fresh, "opt": tx.init(fresh)})
  ckpt.close()
  assert_bitwise(restored["opt"], jax.tree.map(np.asarray, full))
  assert_bitwise(restored["params"], params)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_whole_state_is_not_loaded(comm, tmp_path):
  # The digests are of the whole state as written (test_checkpointer.py's damage and noise).
  sharded = mnjax.shard_optimizer(TX(), comm)
  params = {"w": jnp.arange(4096.0)}
  state = jax.jit(sharded.update)(params, sharded.init(params), params)[1]
  with mnjax.Checkpointer(tmp_path, comm, async_save=False) as ckpt:
    ckpt.save(1, {"opt": state})
    if comm.is_root:
      damage(tmp_path, 1, "flip")
    with pytest.raises(mnjax.checkpoint.CorruptCheckpointError, match="do not match the digests"):
      ckpt.restore({"opt": sharded.init(params)})


@pytest.mark.parametrize("order", ["fewer", "more"])
def test_resumes_resharded_on_another_number_of_ranks(comm, tmp_path, order):
  # Save on every rank and resume on all but the last ("fewer": P -> P - 1), or the reverse
  # ("more"); the last rank alone meanwhile does nothing. 6 rows per rank divide evenly.
  world, colour, first, second = two_sizes(comm, order)
  tx = TX()
  data, split = batches(comm.size), 5
  directory = tmp_path
  full = None
  if colour == 0 or first is comm:
    params, state = train(mnjax.shard_optimizer(tx, first), first, data[:split])
    full = mnjax.optim.gather_optimizer_state(first, tx, state, params)
    with mnjax.Checkpointer(directory, first, async_save=False) as ckpt:
      ckpt.save(split, {"params": params, "opt": state})
    # The unsharded chain over the same ranks, for the comparison below.
    chained, chained_state = train(optax.chain(mnjax.allreduce_gradients(first), tx), first,
                                   data[:split])
  full = world.bcast(full, root=0)  # rank 0 saved in both orders
  chained, chained_state = world.bcast((chained, chained_state) if comm.is_root else None, 0)
  world.Barrier()
  if colour == 0 or second is comm:
    sharded = mnjax.shard_optimizer(tx, second)
    fresh = init_params()
    with mnjax.Checkpointer(directory, second, async_save=False) as ckpt:
      step, restored, _ = ckpt.restore({"params": fresh, "opt": sharded.init(fresh)})
    assert step == split
    state = restored["opt"]
    assert (state.index, state.parts) == (second.rank, second.size)
    # Exactly the cut scatter_optimizer_state makes of the whole saved state for this size.
    expected = mnjax.optim.scatter_optimizer_state(second, tx, full, restored["params"])
    assert_bitwise(state, expected)
    params, state = train(sharded, second, data[split:], restored["params"], state)
    chained, _ = train(optax.chain(mnjax.allreduce_gradients(second), tx), second,
                       data[split:], jax.tree.map(jnp.asarray, chained), chained_state)
    assert_equal(params, chained, rtol=1e-6)  # not bitwise: test_shard.py's docstring
    reference, ref_state = single_process(tx, data)
    assert_equal(params, reference, rtol=1e-5)
    whole = mnjax.optim.gather_optimizer_state(second, tx, state, params)
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(ref_state)):
      np.testing.assert_allclose(x, np.asarray(y), rtol=1e-5, atol=1e-6)
    assert same_on_every_rank(second, params)
  world.Barrier()


def test_loop_checkpoints_carry_the_sharded_state(comm, tmp_path):
  sharded = mnjax.shard_optimizer(TX(), comm)
  params, state = train(sharded, comm, batches(comm.size, steps=2))
  directory = tmp_path
  zero = {"count": 0}
  with mnjax.checkpoint.LoopCheckpoints(directory, comm, resume=False) as loop:
    loop.start({"params": params, "opt": state}, zero)
    loop.save(2, {"params": params, "opt": state}, {"count": 1}, epoch=1, batch=2)
  fresh = init_params()
  with mnjax.checkpoint.LoopCheckpoints(directory, comm, resume=True) as loop:
    got, _, epoch, batch = loop.start({"params": fresh, "opt": sharded.init(fresh)}, zero)
  assert (epoch, batch) == (1, 2)
  assert_bitwise(got, {"params": params, "opt": state})


# -- bad input ----------------------------------------------------------------------------


def test_a_template_sharded_for_another_size_is_refused_on_every_rank(comm, tmp_path):
  sharded = mnjax.shard_optimizer(TX(), comm)
  params = init_params()
  state = sharded.init(params)
  ckpt = mnjax.Checkpointer(tmp_path, comm, async_save=False)
  ckpt.save(1, {"opt": state})
  other = shard.ShardedState(state.inner, comm.rank, comm.size + 1, state.layout)
  with pytest.raises(mnjax.checkpoint.CheckpointTemplateError,
                     match=f"rank 0 holds share 0 of {comm.size + 1}, but the communicator"
                     f" is rank 0 of {comm.size}.*Nothing was loaded"):
    ckpt.restore({"opt": other})
  ckpt.close()


def test_a_state_sharded_over_another_communicator_is_not_saved(comm, tmp_path):
  # Sharded over a size-1 communicator per rank, saved with the job's: each rank would hold
  # a whole state of its own; refused on every rank, nothing written.
  alone = mnjax.create_communicator("flat", comm.mpi_comm.Split(comm.rank, key=0))
  state = mnjax.shard_optimizer(TX(), alone).init(init_params())
  directory = tmp_path
  ckpt = mnjax.Checkpointer(directory, comm, async_save=False)
  if comm.size == 1:  # the same sharding: saved
    ckpt.save(1, {"opt": state})
    assert ckpt.steps() == [1]
  else:
    with pytest.raises(ValueError, match=f"share 0 of 1, but the communicator is rank 0 of"
                       f" {comm.size}.*Nothing was saved"):
      ckpt.save(1, {"opt": state})
    assert ckpt.steps() == []
  ckpt.close()
