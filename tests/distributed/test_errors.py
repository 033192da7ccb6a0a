"""Bad input: a clear error on every rank, before any collective; the job stays usable."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import mnjax


@pytest.fixture(autouse=True)
def collectives_still_line_up(comm):
  """After each error, every rank must still be in step: a rank that had entered a
  collective while another raised would make this allreduce hang (then time out)."""
  yield
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_global_batch_not_divisible_by_ranks(comm):
  # A virtual 3-rank view when this run has one rank: local_batch_size only reads sizes.
  view = comm if comm.size > 1 else dataclasses.replace(comm, size=3)
  with pytest.raises(ValueError, match=rf"not divisible by the {view.size} replicas.*multiple of"):
    mnjax.local_batch_size(4 * view.size + 1, view)
  assert mnjax.local_batch_size(4 * view.size, view) == 4


def test_dataset_smaller_than_number_of_ranks(comm):
  view = comm if comm.size > 1 else dataclasses.replace(comm, size=2)
  with pytest.raises(ValueError,
                     match=rf"{view.size - 1} examples cannot be split over {view.size} ranks"):
    mnjax.scatter_index(view.size - 1, view)
  with pytest.raises(ValueError, match="cannot be split"):
    mnjax.scatter_dataset(list(range(view.size - 1)), view)


def test_non_float_gradient_leaves(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1))
  grads = {"w": jnp.ones(3), "count": jnp.ones(2, jnp.int32)}
  with pytest.raises(TypeError, match=r"floating-point.*leaf \['count'\] has dtype int32"):
    jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads)


def test_unknown_communicator_kind(comm):
  with pytest.raises(ValueError, match=r"unknown communicator kind 'ring'.*Expected one of 'flat'"):
    mnjax.create_communicator("ring")


def test_allreduce_gradients_without_communicator(comm):
  with pytest.raises(TypeError,
                     match=r"needs an mnjax Communicator.*got NoneType.*create_communicator"):
    mnjax.allreduce_gradients(None)
  with pytest.raises(TypeError, match="needs an mnjax Communicator"):
    mnjax.allreduce_gradients(comm.mpi_comm)  # a raw MPI communicator is not enough
