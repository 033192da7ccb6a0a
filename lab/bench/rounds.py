"""Timing variants of a step side by side: alternating rounds, slowest rank, median."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
from mpi4py import MPI

__all__ = ["time_rounds"]


def time_rounds(states: dict[str, Any], run: Callable[[Any], Any] | dict[str, Callable],
                mpi_comm: MPI.Comm, *, rounds: int, steps: int,
                around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None
                ) -> dict[str, float]:
  """Seconds per step of each variant: median over `rounds` of the slowest rank's time.

  Rounds alternate between the variants so that machine noise hits them alike; a round is
  `steps` calls of ``run(state) -> state`` from the variant's state (compiled and warmed up
  by the caller), timed from a barrier to the last result, and the job moves at the pace
  of its slowest rank. `run` may be one function or one per variant; ``around[name]()``
  gives a context entered before that variant's round starts and left after it is timed
  (e.g. a watchdog thread that must run only during its own variant's rounds).

  Example:
    >>> step = jax.jit(lambda s: s * 0.5)
    >>> _ = step(jnp.ones(10)), step(jnp.ones(1000))   # compile, warm up
    >>> time_rounds({"small": jnp.ones(10), "large": jnp.ones(1000)}, step, comm.mpi_comm,
    ...             rounds=3, steps=10)
    {'small': ..., 'large': ...}
  """
  times: dict[str, list[float]] = {name: [] for name in states}
  states = dict(states)
  runs = run if isinstance(run, dict) else dict.fromkeys(states, run)
  around = around or {}
  for _ in range(rounds):
    for name in times:
      state, step = states[name], runs[name]
      with around.get(name, contextlib.nullcontext)():
        mpi_comm.Barrier()
        start = time.perf_counter()
        for _ in range(steps):
          state = step(state)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
      times[name].append(mpi_comm.allreduce(elapsed, op=MPI.MAX) / steps)
      states[name] = state
  return {name: statistics.median(t) for name, t in times.items()}
