"""Each rank drives its own device, and every rank compiles one order of collectives."""

import jax
import jax.numpy as jnp
import optax

import mnjax
from lab.bench.hlo_order import mpi_calls, unchained_compiled
from lab.models import SmallCNN
from lab.runner import create_train_state, make_train_step


def test_flat_rank_drives_its_node_local_device_and_a_plain_jit_runs_there(comm):
  local = jax.local_devices()  # two emulated CPU devices per process (conftest)
  out = jax.jit(lambda x: x * 2)(jnp.ones(3))  # comm is the process's first communicator
  # Gather before asserting: a rank that fails alone must not leave the others waiting.
  everyone = comm.mpi_comm.allgather(
      (comm.intra_rank, [d.id for d in comm.devices], [d.id for d in out.devices()]))
  n = len(local)
  assert everyone == [(r, [r % n], [r % n]) for r in range(comm.size)]  # one host: one node


def test_compiled_step_issues_one_chain_of_collectives_in_the_same_order_on_every_rank(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm, bucket_bytes=64 << 10), optax.sgd(0.1))
  images = jnp.ones((8, 8, 8, 1))
  state = create_train_state(SmallCNN(), tx, images[:1], jax.random.key(0))
  step = make_train_step(comm)
  text = step.lower(state, images, jnp.zeros(8, jnp.int32)).compile().as_text()
  calls = [target for _, target in mpi_calls(text)]
  everyone = comm.mpi_comm.allgather(calls)  # before asserting: no rank fails alone
  assert everyone == [calls] * comm.size
  if comm.size > 1:
    assert len(calls) >= 2, calls  # the digits CNN's 605 kB in 64 kB buckets
    assert unchained_compiled(text) == []
