"""Jobs whose waits can never complete (`python instep_waits.py CASE`, 2 ranks or, for
``stuck_in_own_code``, 3): each must end the job naming the ranks, not hang. No watchdog
runs: the waits themselves end.

- ``peer_finished``: rank 1 runs one step fewer of a send/recv loop and exits normally while
  rank 0 waits in its recv;
- ``allreduce_peer_finished``: rank 1 runs one step fewer of a gradient-allreduce loop and
  exits normally while rank 0 waits in the allreduce;
- ``peer_stalls``: rank 1 sends once and then sleeps (alive, not exiting) while rank 0 waits
  in a second recv: ended by the wait bound, ``MNJAX_WAIT_TIMEOUT``;
- ``allreduce_peer_stalls``: rank 1 reduces once and then sleeps while rank 0 waits in a
  second allreduce: ended by the same bound;
- ``wire_peer_finished``: the 16-bit wire's exchange (an alltoall, then an allgather), with
  rank 1 running one step fewer;
- ``bcast_peer_stalls``: `mnjax.functions.bcast` from rank 0, asleep after one, while rank 1
  waits in a second: ended by the bound;
- ``step_meets_host_round``: rank 0 runs a step's gradient allreduce while rank 1 waits in a
  host round (`bcast_obj`): each waits for the other, and both are named within seconds
  (the wait notices), not at the bound;
- ``recv_meets_host_round``: the same with a second in-step recv against `allreduce_obj`;
- ``host_rounds_in_another_order``: two communicators over the same ranks (the job's and
  ``comm.split(0)``), whose host rounds (`bcast_obj`) rank 0 enters in one order and rank 1
  in the other: each waits in one for the other, named within seconds (the wait notices carry
  the communicator's uid);
- ``host_send_meets_recv_of_another_tag``: rank 0 sends an object with tag 1 while rank 1
  waits for one with tag 2 (the notices of a message's two ends name the ranks and the tag);
- ``stuck_in_own_code``: ranks 0 and 1 wait in a host round (`bcast_obj`) while rank 2, alive,
  sleeps in its own code: at the bound (``MNJAX_WAIT_TIMEOUT``) each waiting rank names the
  other as waiting too and rank 2 as not in the round.
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


def wire_peer_finished(comm) -> None:
  step = jax.jit(lambda g: mnjax.comm.allreduce_tree(g, comm, wire_dtype=jnp.bfloat16))
  for i in range(3 - comm.rank):
    jax.block_until_ready(step({"w": jnp.full(4, float(i))}))
    print(f"rank {comm.rank}: step {i} done", flush=True)


def bcast_peer_stalls(comm) -> None:
  step = jax.jit(lambda x: mnjax.functions.bcast(x, comm, 0))
  for i in range(2 if comm.rank == 1 else 1):
    jax.block_until_ready(step(jnp.full(4, float(i))))
    print(f"rank {comm.rank}: step {i} done", flush=True)
  if comm.rank == 0:
    time.sleep(120)


def step_meets_host_round(comm) -> None:
  if comm.rank == 0:
    step = jax.jit(lambda g: mnjax.comm.allreduce_tree(g, comm))
    jax.block_until_ready(step({"w": jnp.ones(4)}))
  else:
    comm.bcast_obj("hello", root=0)



def recv_meets_host_round(comm) -> None:
  like = jax.ShapeDtypeStruct((4,), jnp.float32)
  recv = jax.jit(lambda: mnjax.functions.recv(comm, 1, like))
  send = jax.jit(lambda x: mnjax.functions.send(x, comm, 0))
  jax.block_until_ready(recv() if comm.rank == 0 else send(jnp.ones(4)))  # checked and met
  if comm.rank == 0:
    jax.block_until_ready(recv())
  else:
    comm.allreduce_obj(1)

def host_rounds_in_another_order(comm) -> None:
  sub = comm.split(0)  # the same ranks, another communicator
  first, second = (comm, sub) if comm.rank == 0 else (sub, comm)
  first.bcast_obj("first", root=0)
  second.bcast_obj("second", root=0)


def host_send_meets_recv_of_another_tag(comm) -> None:
  if comm.rank == 0:
    comm.send_obj("x", dest=1, tag=1)
  else:
    comm.recv_obj(source=0, tag=2)


def stuck_in_own_code(comm) -> None:
  if comm.rank == 2:
    time.sleep(120)
  comm.bcast_obj("hello", root=0)


if __name__ == "__main__":
  comm = mnjax.create_communicator("flat")
  cases = {"peer_finished": peer_finished, "allreduce_peer_finished": allreduce_peer_finished,
           "peer_stalls": peer_stalls, "allreduce_peer_stalls": allreduce_peer_stalls,
           "wire_peer_finished": wire_peer_finished, "bcast_peer_stalls": bcast_peer_stalls,
           "step_meets_host_round": step_meets_host_round,
           "recv_meets_host_round": recv_meets_host_round,
           "host_rounds_in_another_order": host_rounds_in_another_order,
           "host_send_meets_recv_of_another_tag": host_send_meets_recv_of_another_tag,
           "stuck_in_own_code": stuck_in_own_code}
  cases[sys.argv[1]](comm)
  print(f"rank {comm.rank}: returned normally", flush=True)
