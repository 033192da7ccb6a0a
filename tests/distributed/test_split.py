"""`comm.split`: groups of ranks as communicators, and what runs on them (run in 1 process and
under mpirun -n 2 and -n 3; assertions scale with comm.size)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._topology import EMULATE_NODES


def members(comm, color_of):
  return [q for q in range(comm.size) if color_of(q) == color_of(comm.rank)]


def test_a_group_holds_the_ranks_of_one_color_ordered_by_key(comm):
  sub = comm.split(comm.rank % 2, key=-comm.rank)
  group = members(comm, lambda q: q % 2)[::-1]  # by key: the highest parent rank first
  assert (sub.size, sub.rank) == (len(group), group.index(comm.rank))
  assert (sub.kind, sub.devices, sub.axis_name) == (comm.kind, comm.devices, comm.axis_name)
  assert sub != comm and sub.mpi_comm.Get_size() == sub.size
  assert [int(a[0]) for a in sub.allgather(np.array([comm.rank]))] == group
  assert (sub.intra_size, sub.inter_size) == (sub.size, 1)  # one host: one node
  last = comm.size - 1
  rest = comm.split(None if comm.rank == last else 0)
  assert (rest is None) == (comm.rank == last)
  if rest is not None:
    assert rest.size == comm.size - 1


def test_a_group_s_node_topology_comes_from_the_parent_s_nodes(comm, monkeypatch):
  monkeypatch.setenv(EMULATE_NODES, str(comm.size))  # every rank its own (emulated) node
  nodes = mnjax.create_communicator("flat")
  sub = nodes.split(nodes.rank % 2)
  assert (sub.intra_rank, sub.intra_size) == (0, 1)
  assert (sub.inter_rank, sub.inter_size) == (sub.rank, sub.size)


def test_a_data_parallel_step_on_a_group_reduces_within_the_group(comm):
  """Gradients and SyncBatchNorm statistics are the group's means; the program and collective
  checks of data_parallel run on the group (the groups' steps see different data)."""
  sub = comm.split(comm.rank % 2)
  group = members(comm, lambda q: q % 2)
  tx = optax.chain(mnjax.allreduce_gradients(sub), optax.sgd(1.0))
  norm = mnjax.SyncBatchNorm(sub, use_running_average=False, momentum=0.0)
  x = jnp.full((2, 3), float(comm.rank))
  variables = norm.init(jax.random.key(0), x)

  def step(params, batch):
    def loss(p):
      y, new = norm.apply({**variables, "params": p}, batch, mutable=["batch_stats"])
      return jnp.sum(y * batch), new
    grads, new = jax.grad(loss, has_aux=True)(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates, new["batch_stats"]["mean"]

  updates, mean = mnjax.data_parallel(step, sub)(variables["params"], x)
  np.testing.assert_allclose(mean, np.full(3, np.mean(group)), rtol=1e-6)
  # d/d bias of sum(y * x) is the batch's sum of x: each rank's, averaged over the group.
  np.testing.assert_allclose(updates["bias"], np.full(3, -2.0 * np.mean(group)), rtol=1e-6)


def test_the_guards_work_on_a_group(comm):
  sub = comm.split(comm.rank % 2)
  per_group = {"w": jnp.full(2, float(comm.rank % 2))}  # equal within a group only
  mnjax.check_replicas(per_group, sub)
  if comm.size > 1:
    with pytest.raises(ValueError, match="no longer identical"):
      mnjax.check_replicas(per_group, comm)
  with mnjax.Watchdog(sub, timeout=60) as watchdog:
    watchdog.step(0)
  assert sub.bcast_obj(comm.rank if sub.rank == 0 else None) == comm.rank % 2


@pytest.mark.parametrize("case", ["color", "key", "xla"])
def test_a_split_with_an_inconsistent_color_or_key_is_named_on_every_rank(comm, case):
  last = comm.rank == comm.size - 1
  with pytest.raises(ValueError) as error:
    if case == "color":
      comm.split("0" if last else 0)
    elif case == "key":
      comm.split(0, key=1.5 if last else comm.rank)
    else:
      dataclasses.replace(comm, kind="xla").split(0)
  expected = {"color": f"but rank {comm.size - 1} color='0' (str)",
              "key": f"rank {comm.size - 1} key=1.5 (float)", "xla": "kind 'xla'"}[case]
  assert expected in str(error.value)
  if case == "key" and comm.size > 1:  # ranks disagreeing on the kind of key
    with pytest.raises(ValueError, match=f"rank {comm.size - 1} key=None while rank 0 passed 0"):
      comm.split(0, key=None if last else comm.rank)
