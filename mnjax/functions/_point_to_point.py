"""Differentiable point-to-point exchanges inside a jitted step: ChainerMN's send and recv."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from mnjax.comm._communicator import Communicator
from mnjax.functions import _chain as chain
from mnjax.functions import _checks as checks
from mnjax.functions._transport import issue

__all__ = ["pseudo_connect", "recv", "send"]


def send(x: Any, comm: Communicator, dest: int) -> jax.Array:
  """Sends `x` to rank `dest`; returns its delegate, a float32 zero scalar that depends on `x`.

  Differentiating through the delegate receives `x`'s gradient from `dest`: use it as the
  loss of a rank whose output leaves it, or join it to a loss with `pseudo_connect`.

  Example:
    >>> step = jax.jit(lambda x: mnjax.functions.send(x, comm, 1))
    >>> step(jnp.ones(3))               # rank 0 of two; rank 1 calls recv  # doctest: +SKIP
    Array(0., dtype=float32)
  """
  comm = checks.communicator(comm, "send")
  x = checks.payload(x, "send")
  if not checks.checked(dest, comm, "dest", "send", peer=True):
    return jnp.zeros((), jnp.float32) + 0 * chain.scalar(x)  # a stand-in: the check refuses
  dest = int(dest)
  forward = functools.partial(_send, comm, dest, "mnjax.functions.send", "forward")
  backward = functools.partial(_send_backward, comm, dest, x.shape, x.dtype)
  return chain.apply(forward, backward, x, x.dtype, comm, "send")


def recv(comm: Communicator, source: int, like: Any) -> jax.Array:
  """The array rank `source` sends, of `like`'s shape and dtype; its gradient goes back there.

  Example:
    >>> like = jax.ShapeDtypeStruct((3,), jnp.float32)
    >>> step = jax.jit(lambda: mnjax.functions.recv(comm, 0, like))
    >>> step()                           # rank 1 of two; rank 0 calls send  # doctest: +SKIP
    Array([1., 1., 1.], dtype=float32)
  """
  comm = checks.communicator(comm, "recv")
  spec = checks.like_spec(like, "recv")
  if not checks.checked(source, comm, "source", "recv", peer=True):
    return jnp.zeros(spec.shape, spec.dtype)  # a stand-in: the check refuses the step
  source = int(source)
  forward = functools.partial(_recv, comm, source, spec, "mnjax.functions.recv", "forward")
  backward = functools.partial(_recv_backward, comm, source)
  return chain.apply(forward, backward, None, spec.dtype, comm, "recv")


def pseudo_connect(delegate: jax.Array, *xs: Any) -> Any:
  """`xs` unchanged (one array, or a tuple), with `delegate` made part of what they compute.

  ChainerMN's: differentiating through the result also runs `delegate`'s backward.

  Example:
    >>> delegate = jnp.zeros(())                      # e.g. send(h, comm, 1)
    >>> mnjax.functions.pseudo_connect(delegate, jnp.ones(2))
    Array([1., 1.], dtype=float32)
  """
  if not xs:
    raise TypeError("mnjax.functions.pseudo_connect: pass the delegate and at least one"
                    " array to connect it to, e.g. pseudo_connect(delegate, h).")
  delegate = jnp.asarray(delegate)
  out = _connect(delegate, tuple(jnp.asarray(x) for x in xs))
  return out[0] if len(xs) == 1 else out


@jax.custom_vjp
def _connect(delegate, xs):
  del delegate
  return xs


def _connect_fwd(delegate, xs):
  return xs, delegate


def _connect_bwd(delegate, cts):
  return jnp.zeros_like(delegate), cts


_connect.defvjp(_connect_fwd, _connect_bwd)


def _send(comm, dest, label, phase, x, after):
  """One send of `x` to `dest`; returns the delegate."""
  done = issue("send", comm, x, after, shape=(1,), dtype=jnp.float32, wire=x.dtype,
               count=x.size, label=label, note=("send", dest, phase, x.shape, str(x.dtype)),
               peer=dest, tag=0)
  return done.reshape(())


def _recv(comm, source, spec, label, phase, x, after):
  """One receive of `spec` from `source`."""
  del x
  return issue("recv", comm, None, after, shape=spec.shape, dtype=spec.dtype,
               count=math.prod(spec.shape), label=label,
               note=("recv", source, phase, spec.shape, str(spec.dtype)), peer=source, tag=0)


def _send_backward(comm, dest, shape, dtype, ct, after):
  """`send`'s backward: `x`'s gradient, from `dest`."""
  del ct
  spec = jax.ShapeDtypeStruct(shape, dtype)
  grad = _recv(comm, dest, spec, "mnjax.functions.send's backward", "gradient", None, after)
  return grad, grad


def _recv_backward(comm, source, ct, after):
  """`recv`'s backward: its gradient, back to `source`."""
  done = _send(comm, source, "mnjax.functions.recv's backward", "gradient", ct, after)
  return None, done
