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
from lab.models import SmallCNN
from lab.runner import create_train_state, make_train_step
from mnjax.comm._instep import _allreduce as collectives

DIGITS = mnjax.data.load_digits("train")
PER_DEVICE = 4
MODEL = SmallCNN()


# single_node: every process of the job on one node (mpirun on this one machine).
KINDS = ["hierarchical", "two_dimensional", "single_node"]


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
  # bfloat16 on the wire: two roundings of 2^-8 each (mnjax.comm._instep._wire's bound), in norm.
  assert relative_difference(got, expected) <= (1e-5 if wire_dtype is None else 2**-7)
  # Every local device holds the same result.
  for leaf in jax.tree.leaves(got):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == kc.local_device_count
    assert all(np.array_equal(s, shards[0]) for s in shards)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
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


def test_single_node_spans_every_process_of_one_node(comm):
  kc = mnjax.create_communicator("single_node")
  assert (kc.inter_size, kc.inter_rank, kc.intra_size, kc.intra_rank) == (1, 0, kc.size, kc.rank)
  assert kc.size == comm.size and kc.num_replicas == kc.size * kc.local_device_count


def test_single_node_across_nodes_is_refused_on_every_rank(comm, monkeypatch):
  if comm.size == 1:
    pytest.skip("needs several processes to place on several (emulated) nodes")
  monkeypatch.setenv("MNJAX_EMULATE_NODES", str(comm.size))  # one node per rank
  with pytest.raises(ValueError, match=rf"'single_node' keeps every exchange on one node, but"
                                       rf" the {comm.size} processes are on {comm.size} nodes"
                                       r".*'hierarchical'") as info:
    mnjax.create_communicator("single_node")
  assert len(set(comm.mpi_comm.allgather(str(info.value)))) == 1


def test_different_explicit_kinds_are_named_per_rank(comm):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  asked = ["flat", "hierarchical", "two_dimensional"]
  mine = asked[comm.rank % len(asked)]
  with pytest.raises(ValueError) as info:
    mnjax.create_communicator(mine)
  message = str(info.value)
  per_kind = ", ".join(f"{k!r} on ranks {list(range(comm.size))[i::len(asked)]}"
                       for i, k in enumerate(asked[:comm.size]))
  assert f"the ranks asked for different kinds: {per_kind}." in message
  assert "same kind on every rank" in message and "auto" not in message
  assert "GPUs" not in message
  assert len(set(comm.mpi_comm.allgather(message))) == 1  # the same error on every rank


def test_auto_next_to_an_explicit_kind_says_what_auto_chose(comm):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  mine = "auto" if comm.rank == 0 else "hierarchical"
  with pytest.raises(ValueError) as info:
    mnjax.create_communicator(mine)
  message = str(info.value)
  others = list(range(1, comm.size))
  assert f"'auto' (which chose 'flat') on ranks [0], 'hierarchical' on ranks {others}" in message
  assert len(set(comm.mpi_comm.allgather(message))) == 1


def test_auto_choosing_different_kinds_keeps_its_own_message(comm, monkeypatch):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  from mnjax.comm import _create as communicator

  if comm.rank == comm.size - 1:  # as if this rank's node had GPUs
    monkeypatch.setattr(communicator, "resolve_kind", lambda kind: "xla")
  with pytest.raises(ValueError, match=r"create_communicator\('auto'\) chose different kinds"
                                       r" on different ranks.*some nodes see GPUs"):
    mnjax.create_communicator("auto")


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
def test_a_correct_port_is_quiet(kind):
  """A script that reads comm.rank / comm.size (never jax.process_index) gets no warning."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kc = mnjax.create_communicator(kind)
    shard = mnjax.scatter_index(12, kc)
    writer = kc.is_root
  # The mapping the port uses: comm.rank / comm.size are the process index / count.
  ranks = sorted(kc.mpi_comm.allgather(kc.rank))
  assert ranks == list(range(kc.size)) == list(range(MPI.COMM_WORLD.size))
  assert [str(w.message)[:80] for w in caught if "mnjax" in str(w.message)] == []
  assert len(shard) == 12 // kc.size and writer == (kc.rank == 0)


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_jax_process_index_warns_where_the_script_calls_it_and_the_value_is_wrong(kind):
  if MPI.COMM_WORLD.size == 1:
    pytest.skip("one process: jax.process_index() is right (see the single-process test)")
  kc = mnjax.create_communicator(kind)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # The MPI kinds do not start jax.distributed: JAX sees one process on every rank.
    values = (jax.process_index(), jax.process_count())
  assert values == (0, 1)
  noted = [w for w in caught if str(w.message).startswith("mnjax: jax.process_index")]
  # Rank 0 is process 0: only the other ranks read a wrong value (once per call).
  assert len(noted) == (0 if kc.is_root else 2)
  for w, name, value in zip(noted, ("jax.process_index", "jax.process_count"), values):
    message = str(w.message)
    assert f"{name}() returned {value} on rank {kc.rank} of this {kc.size}-process job" in message
    assert "comm.rank for jax.process_index()" in message and "comm.is_root" in message
    # It points at the line that called it.
    assert w.category is UserWarning and w.filename == __file__


def test_mnjax_own_calls_of_jax_process_index_are_quiet(comm):
  code = compile("import jax\nvalue = jax.process_count()", "<mnjax-internal>", "exec")
  scope = {"__name__": "mnjax.checkpoint._fake"}  # as if mnjax's own module called it
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    exec(code, scope)
  assert scope["value"] == 1


def test_a_single_process_does_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert mnjax.create_communicator("flat", MPI.COMM_SELF).size == 1
    if MPI.COMM_WORLD.size == 1:  # nothing is watched: JAX's view is the job's
      assert (jax.process_index(), jax.process_count()) == (0, 1)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_wait_bound_is_refused_at_creation_on_every_rank(comm, monkeypatch, value):
  monkeypatch.setenv("MNJAX_WAIT_TIMEOUT", value)
  with pytest.raises(ValueError, match=f"MNJAX_WAIT_TIMEOUT must be a number of seconds > 0,"
                                       f" got '{value}'"):
    mnjax.create_communicator("flat")
