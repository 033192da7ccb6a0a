"""Ranks that reach different mnjax rounds at the same point get one clear error, on every rank.

Every host round's record names its operation first, compared before anything else is read
(`mnjax.comm._agreement.gather_if_different`): the last rank runs one operation, the others
another, and every rank raises the same `ValueError` naming both, instead of unpacking the
other ranks' records in a format they do not have.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mnjax


@pytest.fixture(autouse=True)
def collectives_still_line_up(comm):
  """After each error every rank must still be in step."""
  yield
  assert comm.mpi_comm.allreduce(1) == comm.size


def _broadcast(comm):
  mnjax.broadcast({"w": np.zeros(3, np.float32)}, comm)


def _bcast(comm):
  comm.bcast(np.zeros(3, np.float32), root=0)


def _bcast_obj(comm):
  comm.bcast_obj({"epoch": 3}, root=0)


def _allgather_obj_like(comm):
  comm.gather_obj(comm.rank, root=0)


def _allreduce_preflight(comm):
  tx = mnjax.allreduce_gradients(comm)
  params = {"w": jnp.ones(3)}
  jax.jit(tx.update)(params, tx.init(params), params)


def _step_check(comm):
  def step(x):
    return mnjax.comm.allreduce_tree(x * 2.0, comm)
  mnjax.data_parallel(step, comm, batch_argnums=(0,))(jnp.ones(4))


def _checkpointer(comm):
  mnjax.Checkpointer(tempfile.mkdtemp(prefix="mnjax-rounds-"), comm)


def _check_replicas(comm):
  mnjax.check_replicas({"w": np.zeros(3, np.float32)}, comm)


OPERATIONS = {
    "broadcast": (_broadcast, "broadcast"),
    "bcast": (_bcast, "bcast"),
    "bcast_obj": (_bcast_obj, "bcast_obj"),
    "gather_obj": (_allgather_obj_like, "gather_obj"),
    "allreduce pre-flight": (_allreduce_preflight, "allreduce_gradients's pre-flight check"),
    "step check": (_step_check, "the step's check of its in-step collectives"),
    "checkpointer": (_checkpointer, "Checkpointer's directory check"),
    "check_replicas": (_check_replicas, "check_replicas"),
}
PAIRS = [("broadcast", "bcast_obj"), ("bcast", "bcast_obj"), ("step check", "broadcast"),
         ("allreduce pre-flight", "bcast_obj"), ("broadcast", "allreduce pre-flight"),
         ("step check", "bcast_obj"), ("gather_obj", "bcast"), ("checkpointer", "bcast_obj"),
         ("check_replicas", "step check"), ("broadcast", "checkpointer")]


@pytest.mark.parametrize(("mine", "last"), PAIRS, ids=[f"{a}-vs-{b}" for a, b in PAIRS])
def test_different_rounds_raise_one_error_on_every_rank(comm, mine, last):
  if comm.size < 2:
    pytest.skip("needs two ranks: one of them reaches another round (runs under mpirun)")
  run, _ = OPERATIONS[last if comm.rank == comm.size - 1 else mine]
  with pytest.raises(ValueError, match="reached different mnjax rounds") as info:
    run(comm)
  message = str(info.value)
  for name in (mine, last):
    assert repr(OPERATIONS[name][1]).strip("'") in message, message
  assert f"rank {comm.size - 1}" in message
  assert len(set(comm.mpi_comm.allgather(message))) == 1  # the same words on every rank


def test_operations_are_compared_before_anything_else(comm):
  """The checker names each rank's operation, world ranks where they differ."""
  from mpi4py import MPI

  from mnjax.comm._host._agreement import check_same_operation

  check_same_operation(["broadcast"] * 3, MPI.COMM_WORLD)  # the same: nothing raised
  with pytest.raises(ValueError, match=r"rank 0 in 'broadcast', rank 1 in 'bcast_obj'"):
    check_same_operation(["broadcast", "bcast_obj"], MPI.COMM_SELF)
