"""Differentiable communication inside a jitted step: ChainerMN's ``chainermn.functions``.

For model parallelism, where each rank holds part of a model and activations travel
between ranks inside every rank's own step:

* `send` / `recv`: point to point; `send` returns a delegate whose gradient is received
  from the peer, `recv`'s gradient goes back to the sender. `pseudo_connect` joins a
  delegate to other values of a loss.
* `bcast`, `gather`, `scatter` (rooted), `allgather`, `alltoall`: collectives whose
  backward is the transposed exchange (a sum to the root, a scatter, a gather, an
  all-to-all).

They work inside plain ``jax.jit`` on every rank: the first call of the step (its lowering)
checks across the ranks that their exchanges pair up (wrong peer, shape, dtype or order: an
`ExchangeError` on every rank, before anything is exchanged). `jit` is ``jax.jit`` with
that check run when the step is traced, on every rank of a given communicator, also on a
rank whose step exchanges nothing; it also admits `mnjax.SyncBatchNorm` in the step.

Kind ``flat`` (one CPU device per process); the other kinds are refused when a function is
called, naming what to use instead. Design: docs/design/functions.md.

Example::

    stage0 = jax.jit(lambda p, x: jax.grad(
        lambda p: mnjax.functions.send(f(p, x), comm, 1))(p))                  # rank 0
    stage1 = jax.jit(lambda p, y: jax.value_and_grad(
        lambda p: loss(g(p, mnjax.functions.recv(comm, 0, like)), y))(p))      # rank 1
"""

from mnjax.functions._collective import allgather, alltoall, bcast, gather, scatter
from mnjax.functions._point_to_point import pseudo_connect, recv, send
from mnjax.functions._step import jit
from mnjax.guard._pairing import ExchangeError

__all__ = [
    "ExchangeError",
    "allgather",
    "alltoall",
    "bcast",
    "gather",
    "jit",
    "pseudo_connect",
    "recv",
    "scatter",
    "send",
]
