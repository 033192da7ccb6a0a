"""`ChannelParallelConv`: ChainerMN's channel-parallel convolution as a flax module."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mnjax.comm._communicator import Communicator

__all__ = ["ChannelParallelConv", "join_slices", "slice_grads"]


class ChannelParallelConv(nn.Module):
  """``nn.Conv`` with this rank's ``features // comm.size`` output channels; returns them all.

  Joined by `mnjax.functions.allgather` in rank order; ``init`` sends nothing.

  Example:
    >>> conv = mnjax.model_parallel.ChannelParallelConv(comm, features=4, kernel_size=(3, 3))
    >>> x = jnp.ones((2, 8, 8, 1))
    >>> variables = conv.init(jax.random.key(0), x)
    >>> variables["params"]["slice"]["kernel"].shape, conv.apply(variables, x).shape
    ((3, 3, 1, 4), (2, 8, 8, 4))
  """

  comm: Communicator
  features: int
  kernel_size: tuple[int, int]
  use_bias: bool = True
  padding: str = "SAME"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    size = self.comm.size
    if self.features % size:
      raise ValueError(f"ChannelParallelConv: features={self.features} must divide by the"
                       f" number of ranks {size} (each holds features // size channels).")
    y = nn.Conv(self.features // size, self.kernel_size, padding=self.padding,
                use_bias=self.use_bias, name="slice")(x)
    if size == 1:
      return y
    if self.is_initializing():  # init needs the shapes only: no message outside a step
      return jnp.concatenate([y] * size, axis=-1)
    from mnjax import functions  # noqa: PLC0415 (the in-step transport)
    gathered = functions.allgather(y, self.comm)               # (size, ..., features // size)
    return jnp.concatenate(list(gathered), axis=-1)


def join_slices(slices: list[Any]) -> Any:
  """The ``nn.Conv`` parameters of every rank's `ChannelParallelConv` ones (``slices[rank]``).

  Example:
    >>> part = {"slice": {"kernel": jnp.ones((3, 3, 1, 2)), "bias": jnp.zeros(2)}}
    >>> join_slices([part, part])["kernel"].shape
    (3, 3, 1, 4)
  """
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=-1), *[s["slice"] for s in slices])


def slice_grads(grads: Any, comm: Communicator) -> Any:
  """This rank's slice of the model's gradient: the allgather's summed gradient / ``comm.size``.

  Example:
    >>> slice_grads({"slice": {"bias": jnp.full(2, 2.0)}}, comm)["slice"]["bias"].tolist()
    [2.0, 2.0]
  """
  return jax.tree.map(lambda g: g / comm.size, grads)
