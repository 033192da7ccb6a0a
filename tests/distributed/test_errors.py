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


@pytest.mark.parametrize("double_buffering", [False, True])
def test_an_eager_update_says_what_came_and_to_call_it_in_the_step(comm, double_buffering):
  """Outside a traced step the exchange cannot run over several replicas (a Python float leaf
  included); hierarchical has two replicas in one process too."""
  kc = comm if comm.num_replicas > 1 else mnjax.create_communicator("hierarchical")
  if kc.num_replicas == 1:
    pytest.skip("needs several replicas (two local devices, or mpirun)")
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1), kc, double_buffering=double_buffering)
  grads = {"w": 1.0}
  with pytest.raises(ValueError, match=r"(?s)outside a traced step.*leaf \['w'\] is a Python"
                                       r" float \(1\.0\).*inside the jitted step"):
    tx.update(grads, tx.init(grads))
  with pytest.raises(ValueError, match=r"(?s)outside a traced step.*float32\[3\]"):
    tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))


def test_a_python_float_leaf_in_a_traced_update_is_a_float32(comm):
  tx = mnjax.allreduce_gradients(comm)
  out = jax.jit(lambda state: tx.update({"w": 1.0}, state)[0])(tx.init({"w": 1.0}))
  assert float(out["w"]) == 1.0
