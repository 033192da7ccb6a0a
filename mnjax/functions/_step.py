"""`jit`: a model-parallel step checked across ranks when it is traced.

A model-parallel step differs per rank by design (rank 0 runs the first layers and sends,
rank 1 receives and runs the next), so `mnjax.data_parallel`'s comparison of whole programs
does not apply; what must agree is how the ranks' exchanges pair up. Plain ``jax.jit``
steps are checked when lowered (`mnjax.functions._trace_check`), over the communicator
their exchanges use. `jit` is ``jax.jit(fn)`` whose trace records the step's in-step
exchanges and collectives and checks them across the ranks of a given communicator before
the compiled step first runs (`mnjax.guard._pairing`): the same code path as
``mnjax.data_parallel(fn, comm, batch_argnums=(), check_program=False)``. Use it for a rank
whose step exchanges nothing (it must still join the check) and for a step with
`mnjax.SyncBatchNorm`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.functions import _checks as checks
from mnjax.train._parallel import data_parallel

__all__ = ["jit"]


def jit(fn: Callable[..., Any], comm: Communicator) -> Callable[..., Any]:
  """``jax.jit(fn)`` for a step of a model-parallel program, checked over `comm` once per
  trace (plain ``jax.jit`` works too; this one also joins the check on a rank whose step
  exchanges nothing, and admits `mnjax.SyncBatchNorm`).

  Before the compiled step first runs (and after each retrace), every rank sends a hash of
  its in-step exchanges to the others (one small host allgather; the sequences travel only
  when they differ, which model parallelism makes the rule) and checks that they pair up:
  each send meets a recv on its peer, from this rank, with the same shape and dtype, in the
  same order. Otherwise every rank raises the same `mnjax.functions.ExchangeError`, naming
  the first exchange of each rank that no rank answers. Every rank must call its step (the
  check is collective over ``comm.mpi_comm``).

  Args:
    fn: the step; may call `mnjax.functions` (forward and under ``jax.grad``),
      `mnjax.allreduce_gradients` (also over a sub-communicator: its buckets name their
      ranks, so data x model parallelism pairs in one step) and `mnjax.SyncBatchNorm` over
      `comm` (its collectives read as ones over every rank of `comm`).
    comm: the ``flat`` `Communicator` the check runs over: one holding every rank the step
      exchanges with (usually the whole job's).

  Returns:
    The jitted step.

  Example:
    >>> step = mnjax.functions.jit(lambda x: mnjax.functions.allgather(x, comm), comm)
    >>> step(jnp.ones(2)).shape == (comm.size, 2)
    True
  """
  comm = check_communicator(comm, "mnjax.functions.jit")
  if comm.kind != "flat":
    checks.communicator(comm, "jit")  # raises, naming the kind
  return functools.wraps(fn)(data_parallel(fn, comm, batch_argnums=(), check_program=False))
