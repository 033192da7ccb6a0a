"""Jobs whose in-step exchange can never complete (`python instep_waits.py CASE`, 2 ranks):
each must end the job naming the ranks, not hang. No watchdog runs: the waits themselves end.

- ``peer_finished``: rank 1 runs one step fewer of a send/recv loop and exits normally while
  rank 0 waits in its recv;
- ``allreduce_peer_finished``: rank 1 runs one step fewer of a gradient-allreduce loop and
  exits normally while rank 0 waits in the allreduce;
- ``peer_stalls``: rank 1 sends once and then sleeps (alive, not exiting) while rank 0 waits
  in a second recv: ended by the wait bound, ``MNJAX_WAIT_TIMEOUT``;
- ``allreduce_peer_stalls``: rank 1 reduces once and then sleeps while rank 0 waits in a
  second allreduce: ended by the same bound.
"""

import sys
import time

import jax
import jax.numpy as jnp

import mnjax


def peer_finished(comm) -> None:
  like = jax.ShapeDtypeStruct((4,), jnp.float32)
  if comm.rank == 0:
    step = jax.jit(lambda: mnjax.functions.recv(comm, 1, like))
    steps = 3
  else:
    step = jax.jit(lambda x: mnjax.functions.send(x, comm, 0))
    steps = 2
  for i in range(steps):
    jax.block_until_ready(step() if comm.rank == 0 else step(jnp.full(4, float(i))))
    print(f"rank {comm.rank}: step {i} done", flush=True)


def allreduce_peer_finished(comm) -> None:
  step = jax.jit(lambda g: mnjax.comm.allreduce_tree(g, comm))
  for i in range(3 - comm.rank):
    jax.block_until_ready(step({"w": jnp.full(4, float(i))}))
    print(f"rank {comm.rank}: step {i} done", flush=True)


def peer_stalls(comm) -> None:
  like = jax.ShapeDtypeStruct((4,), jnp.float32)
  if comm.rank == 0:
    step = jax.jit(lambda: mnjax.functions.recv(comm, 1, like))
    for _ in range(2):
      jax.block_until_ready(step())
  else:
    jax.block_until_ready(jax.jit(lambda x: mnjax.functions.send(x, comm, 0))(jnp.ones(4)))
    time.sleep(120)


def allreduce_peer_stalls(comm) -> None:
  step = jax.jit(lambda g: mnjax.comm.allreduce_tree(g, comm))
  for i in range(2 if comm.rank == 0 else 1):
    jax.block_until_ready(step({"w": jnp.full(4, float(i))}))
    print(f"rank {comm.rank}: step {i} done", flush=True)
  if comm.rank == 1:
    time.sleep(120)


if __name__ == "__main__":
  comm = mnjax.create_communicator("flat")
  cases = {"peer_finished": peer_finished, "allreduce_peer_finished": allreduce_peer_finished,
           "peer_stalls": peer_stalls, "allreduce_peer_stalls": allreduce_peer_stalls}
  cases[sys.argv[1]](comm)
  print(f"rank {comm.rank}: returned normally", flush=True)
