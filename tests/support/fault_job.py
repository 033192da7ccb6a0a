"""A small 2-rank training loop that fails on purpose: ``python fault_job.py MODE``.

Modes: ``ok``; ``raise`` (rank 1 raises at step 3); ``kill`` / ``kill_root`` (rank 1 / rank 0
SIGKILLs itself at step 3); ``stop_root`` (rank 0 SIGSTOPs itself at step 3: alive, silent);
``stall`` (rank 1 sleeps at step 3); ``root_lingers`` / ``worker_lingers`` (rank 0 / rank 1
keeps its watchdog running alone, after the other rank stopped its own, for longer than the
watchdog's timeouts: a normal end, not a stall); ``worker_short`` / ``root_short`` (rank 1 /
rank 0 runs one step fewer and finishes while the other waits in that step's collective).
The watchdog runs with short timeouts so
that tests/jobs/test_fault_job.py finishes quickly.
"""

import os
import re
import signal
import sys
import time

import jax
import jax.numpy as jnp
import optax

import mnjax

STEPS, FAULT_STEP = 8, 3


def early_finish_named(stdout: str, short: int, waiting: int) -> bool:
  """Whether `stdout` names rank `short` as finished while rank `waiting` waits in the last
  step's collective: the waiting rank's in-step allreduce says so itself (after a 2 s grace),
  the watchdog (3 s timeouts here) with the steps when it is first."""
  watchdog = (rf"mnjax watchdog: rank {short} finished \(after step {STEPS - 2} and"
              rf" {STEPS - 1} in-step collectives\) while rank {waiting} has waited \d+ s in"
              rf" in-step collective #{STEPS} \(at step {STEPS - 1}\), which rank {short} never"
              " entered")
  instep = (rf"mnjax: rank {waiting} \(world rank {waiting}\) waits in an in-step allreduce"
            rf" \(tag \d+\), but rank {short} \(world rank {short}\) finished its program")
  return re.search(f"{watchdog}|{instep}", stdout) is not None


def main(mode: str) -> None:
  comm = mnjax.create_communicator("flat")
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1))
  params = {"w": jnp.ones(16)}
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    grads = jax.tree.map(lambda p: p * (comm.rank + 1), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with mnjax.Watchdog(comm, timeout=3.0, heartbeat_timeout=3.0, interval=0.5) as watchdog:
    short = {"worker_short": 1, "root_short": 0}.get(mode) == comm.rank
    for i in range(STEPS - 1 if short else STEPS):
      watchdog.step(i)
      if i == FAULT_STEP:
        if mode == "raise" and comm.rank == 1:
          raise RuntimeError("injected failure on rank 1")
        if mode == "kill" and comm.rank == 1 or mode == "kill_root" and comm.rank == 0:
          os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop_root" and comm.rank == 0:  # alive but silent: no launcher notices
          os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "stall" and comm.rank == 1:
          time.sleep(120)
      params, opt_state = step(params, opt_state)
      jax.block_until_ready(params)
    lingering = {"root_lingers": 0, "worker_lingers": 1}.get(mode)
    if comm.rank == lingering:
      time.sleep(6.0)
  print(f"rank {comm.rank} finished", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
