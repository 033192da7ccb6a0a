"""Differentiable communication inside a jitted step: ChainerMN's ``chainermn.functions``.

* `send` / `recv`: point to point; `pseudo_connect` joins `send`'s delegate to a loss.
* `bcast`, `gather`, `scatter`, `allgather`, `alltoall`: collectives.
* `jit`: ``jax.jit`` with the pairing check, also on a rank whose step exchanges nothing.

A step's exchanges must pair up across ranks (else `ExchangeError` on every rank). Kind
``flat`` on CPU devices only. Design: docs/design/functions.md.

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
