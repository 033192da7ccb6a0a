"""Communicators: several devices per process (every kind averages like flat, replicas stay
identical), and JAX's process view under the MPI kinds (what ported pmap code reads)."""

import hashlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import mnjax
from mnjax.comm import _collectives as collectives
from mnjax.models import SmallCNN
from mnjax.train._classifier import create_train_state, make_train_step

DIGITS = mnjax.data.load_digits("train")
PER_DEVICE = 4
MODEL = SmallCNN()


# single_node refuses several processes (tested below), so it joins only single-process runs.
KINDS = ["hierarchical", "two_dimensional"] + (["single_node"] if MPI.COMM_WORLD.size == 1 else [])


def loss(params, images, labels):
  logits = MODEL.apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def relative_difference(a, b):
  diffs = jax.tree.map(lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(y)), a, b)
  return max(jax.tree.leaves(diffs))


@pytest.mark.parametrize("wire_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_kind_averages_gradients_like_flat_over_the_same_global_batch(comm, kind, wire_dtype):
  kc = mnjax.create_communicator(kind)
  global_batch = PER_DEVICE * kc.num_replicas
  images, labels = DIGITS.images[:global_batch], DIGITS.labels[:global_batch]
  params = MODEL.init(jax.random.key(0), images[:1])["params"]

  def averaged_grads(p, x, y):
    return collectives.allreduce_tree(jax.grad(loss)(p, x, y), kc, wire_dtype=wire_dtype)

  step = mnjax.data_parallel(averaged_grads, kc, batch_argnums=(1, 2))
  mine = slice(kc.rank * PER_DEVICE * kc.local_device_count,
               (kc.rank + 1) * PER_DEVICE * kc.local_device_count)
  got = step(params, images[mine], labels[mine])
  # What `flat` computes with one process per replica: the mean-loss gradient of the
  # global batch (each replica's mean loss averaged over equal-size replicas).
  expected = jax.jit(jax.grad(loss))(params, images, labels)
  # bfloat16 on the wire: two roundings of 2^-8 each (mnjax.comm._wire's bound), in norm.
  assert relative_difference(got, expected) <= (1e-5 if wire_dtype is None else 2**-7)
  # Every local device holds the same result.
  for leaf in jax.tree.leaves(got):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == kc.local_device_count
    assert all(np.array_equal(s, shards[0]) for s in shards)


@pytest.mark.parametrize("kind", ["hierarchical", "two_dimensional"])
def test_parameters_identical_on_every_device_of_every_process(comm, kind):
  kc = mnjax.create_communicator(kind)
  tx = optax.chain(mnjax.allreduce_gradients(kc), optax.adam(1e-3))
  state = create_train_state(MODEL, tx, DIGITS.images[:1], jax.random.key(kc.rank))
  state = mnjax.broadcast(state, kc)
  step = make_train_step(kc)
  for idx, _ in mnjax.epoch_batches(len(DIGITS), kc, 8 * kc.num_replicas, shuffle=True):
    state, metrics = step(state, DIGITS.images[idx], DIGITS.labels[idx])
    if int(state.step) == 5:
      break
  assert int(metrics["count"]) == 8 * kc.local_device_count  # this process's examples
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(state.params):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == kc.local_device_count
    assert all(np.array_equal(s, shards[0]) for s in shards)
    h.update(shards[0].tobytes())
  assert len(set(kc.mpi_comm.allgather(h.hexdigest()))) == 1


def test_more_local_devices_than_exist(comm):
  have = jax.local_device_count()
  with pytest.raises(ValueError, match=rf"{have + 1} local devices requested, but this process"
                                       rf" has {have}.*xla_force_host_platform_device_count"):
    mnjax.create_communicator("hierarchical", local_devices=have + 1)
  assert comm.mpi_comm.allreduce(1) == comm.size  # no rank entered the collective setup


def test_process_batch_that_does_not_split_over_local_devices(comm):
  kc = mnjax.create_communicator("two_dimensional")
  if kc.local_device_count == 1:
    pytest.skip("needs >= 2 local devices (conftest emulates 2)")
  step = mnjax.data_parallel(lambda p, x: p, kc, batch_argnums=(1,))
  with pytest.raises(ValueError, match=r"3 examples on this process, which do not split over"
                                       r" its 2 local devices"):
    step(jnp.zeros(2), np.zeros((3, 4)))


def test_single_node_under_several_processes(comm):
  if comm.size == 1:
    assert mnjax.create_communicator("single_node").inter_size == 1
    return
  with pytest.raises(ValueError, match=rf"'single_node'.*{comm.size} processes.*'hierarchical'"):
    mnjax.create_communicator("single_node")
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_flat_drives_one_device_only(comm):
  with pytest.raises(ValueError, match="drives one device per process"):
    mnjax.create_communicator("flat", local_devices=2)


def test_xla_after_jax_started_is_a_clear_error_on_every_rank(comm):
  jax.devices()  # this test process has used JAX already: jax.distributed can no longer start
  with pytest.raises(ValueError,
                     match=r"create_communicator\('xla'\) must run before JAX uses any device"):
    mnjax.create_communicator("xla")
  assert comm.mpi_comm.allreduce(1) == comm.size


# -- jax.process_index() under the MPI kinds -------------------------------------------------

@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_rank_zero_warns_once_that_jax_process_index_is_not_the_rank(kind):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kc = mnjax.create_communicator(kind)
  noted = [w for w in caught if str(w.message).startswith("mnjax: jax.process_index()")]
  # The MPI kinds do not start jax.distributed: JAX sees one process on every rank.
  assert (jax.process_index(), jax.process_count()) == (0, 1)
  assert len(noted) == (1 if kc.size > 1 and kc.is_root else 0)
  if noted:
    message = str(noted[0].message)
    assert f"in this {kc.size}-process job" in message
    assert "comm.rank for jax.process_index()" in message and "comm.is_root" in message
    assert noted[0].category is UserWarning and noted[0].filename == __file__
  # The mapping the warning gives: comm.rank / comm.size are the process index / count.
  ranks = sorted(kc.mpi_comm.allgather(kc.rank))
  assert ranks == list(range(kc.size)) == list(range(MPI.COMM_WORLD.size))


def test_a_single_process_does_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert mnjax.create_communicator("flat", MPI.COMM_SELF).size == 1
