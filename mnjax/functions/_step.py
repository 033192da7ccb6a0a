"""`jit`: a model-parallel step whose exchanges are checked across ranks when it is traced."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.functions import _checks as checks
from mnjax.train._parallel import data_parallel

__all__ = ["jit"]


def jit(fn: Callable[..., Any], comm: Communicator) -> Callable[..., Any]:
  """``jax.jit(fn)`` for a model-parallel step, checked over `comm` once per trace.

  Before the step first runs, the ranks check that their exchanges pair up (else every rank
  raises `mnjax.functions.ExchangeError`); unlike plain ``jax.jit``, also on a rank whose step
  exchanges nothing. `comm`: a ``flat`` `Communicator` holding every rank the step exchanges
  with. `fn` may also call `mnjax.SyncBatchNorm` and `mnjax.allreduce_gradients`.

  Example:
    >>> step = mnjax.functions.jit(lambda x: mnjax.functions.allgather(x, comm), comm)
    >>> step(jnp.ones(2)).shape == (comm.size, 2)
    True
  """
  comm = check_communicator(comm, "mnjax.functions.jit")
  if comm.kind != "flat":
    checks.communicator(comm, "jit")  # raises, naming the kind
  return functools.wraps(fn)(data_parallel(fn, comm, batch_argnums=(), check_program=False))
