"""`jit`: a model-parallel step checked across ranks when it is traced.

``mnjax.data_parallel(fn, comm, batch_argnums=(), check_program=False)``: its trace records
the step's exchanges and collectives and checks that they pair up across the ranks of
`comm` (`mnjax.guard._pairing`). Use it for a rank whose step exchanges nothing and for a
step with `mnjax.SyncBatchNorm`.
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
  trace; unlike plain ``jax.jit`` it also joins the check on a rank whose step exchanges
  nothing, and admits `mnjax.SyncBatchNorm`.

  Before the compiled step first runs, the ranks check that their exchanges pair up (each
  send meets a recv on its peer with the same shape and dtype, in the same order); else
  every rank raises the same `mnjax.functions.ExchangeError`. Collective over
  ``comm.mpi_comm``: every rank must call its step.

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
