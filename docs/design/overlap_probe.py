"""The figures of docs/design/allreduce.md, "The exchange beside compute": one jitted step
that holds an allreduce and a computation independent of it, timed against each alone.

    .venv/bin/mpirun -n 2 .venv/bin/python docs/design/overlap_probe.py late
    .venv/bin/python -m lab.cluster run --nodes 2 --rate 1gbit -- \\
        .venv/bin/python docs/design/overlap_probe.py link

``late``: a 4 kB allreduce that waits for rank 1, which enters 300 ms late, beside six
1024 x 1024 matmuls. ``link``: a 20 MB allreduce (over the emulated link) beside the same
matmuls. Prints rank 0's best of 5, in ms: overlapped, "both" is the larger of the other two.
"""

import sys
import time

from mpi4py import MPI  # noqa: F401  (MPI_Init before jax: docs/design/launchers.md)

# isort: split
import jax
import jax.numpy as jnp

import mnjax


def main(case: str) -> None:
  comm = mnjax.create_communicator("flat")
  late = case == "late"
  pending = {"g": jnp.ones(1_000 if late else 5_000_000)}
  x = jnp.ones((1024, 1024))

  def compute(x):
    for _ in range(6):
      x = jnp.tanh(x @ x / 1024.0)
    return x

  def exchange(g):
    return mnjax.comm.allreduce_tree(g, comm, bucket_bytes=None)

  steps = {"exchange": (jax.jit(exchange), (pending,)), "compute": (jax.jit(compute), (x,)),
           "both": (jax.jit(lambda g, x: (exchange(g), compute(x))), (pending, x))}
  best = {}
  for name, (step, args) in steps.items():
    jax.block_until_ready(step(*args))
    best[name] = float("inf")
    for _ in range(5):
      comm.mpi_comm.Barrier()
      if late and comm.rank == 1 and name != "compute":
        time.sleep(0.3)
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      best[name] = min(best[name], time.perf_counter() - start)
  if comm.rank == 0:
    print(case, {name: round(seconds * 1e3, 1) for name, seconds in best.items()}, flush=True)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "late")
