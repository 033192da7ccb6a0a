"""`MultiNodeNStepRNN`: ChainerMN's ``create_multi_node_n_step_rnn`` as a flax module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.model_parallel._messages import recv_tree, send_tree, spec

__all__ = ["MultiNodeNStepRNN"]


def _peer(rank: Any, comm: Communicator, name: str) -> None:
  if rank is None:
    return
  if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < comm.size:
    raise ValueError(f"MultiNodeNStepRNN: {name}={rank!r} is not a rank of the communicator"
                     f" (ranks 0..{comm.size - 1}); pass the rank the carries come from"
                     " (rank_in) or go to (rank_out), or None.")
  if rank == comm.rank:
    raise ValueError(f"MultiNodeNStepRNN: {name}={rank} is this rank itself; the carries go"
                     " to another rank (pass None for none).")


class MultiNodeNStepRNN(nn.Module):
  """``nn.RNN`` layers whose initial carries come from `rank_in`, final ones go to `rank_out`.

  ``__call__(xs, seq_lengths=None)`` returns ``(carries, ys, delegate)``; join the delegate
  (None without `rank_out`) to this rank's loss or make it the loss. ChainerMN's seq2seq:
  ``rank_out=1`` on rank 0, ``rank_in=0`` on rank 1.

  Example:
    >>> rnn = mnjax.model_parallel.MultiNodeNStepRNN(
    ...     comm, [nn.RNN(nn.LSTMCell(4)), nn.RNN(nn.GRUCell(4))])
    >>> xs = jnp.ones((2, 5, 3))                                  # batch, time, features
    >>> variables = rnn.init(jax.random.key(0), xs)
    >>> carries, ys, delegate = rnn.apply(variables, xs)
    >>> ys.shape, delegate is None
    ((2, 5, 4), True)
  """

  comm: Communicator
  layers: Sequence[nn.RNN]
  rank_in: int | None = None
  rank_out: int | None = None

  def __post_init__(self) -> None:
    check_communicator(self.comm, "MultiNodeNStepRNN")
    if not self.layers or not all(isinstance(layer, nn.RNN) for layer in self.layers):
      raise TypeError(f"MultiNodeNStepRNN: layers must be a non-empty list of flax nn.RNN"
                      f" layers (e.g. [nn.RNN(nn.LSTMCell(64))] * 2), got {self.layers!r}.")
    _peer(self.rank_in, self.comm, "rank_in")
    _peer(self.rank_out, self.comm, "rank_out")
    super().__post_init__()

  def _carry_specs(self, xs: jax.Array) -> list[Any]:
    """Each layer's carry shapes for `xs`."""
    specs = []
    for layer in self.layers:
      axis = 0 if layer.time_major else xs.ndim - (layer.cell.num_feature_axes + 1)
      step = xs.shape[:axis] + xs.shape[axis + 1:]
      specs.append(spec(jax.eval_shape(
          lambda key, cell=layer.cell, step=step: cell.initialize_carry(key, step),
          jax.random.key(0))))
    return specs

  def __call__(self, xs: jax.Array, seq_lengths: jax.Array | None = None
               ) -> tuple[tuple[Any, ...], jax.Array, jax.Array | None]:
    messages = not self.is_initializing()  # init needs the shapes only: no message
    carries: list[Any] = [None] * len(self.layers)
    if messages and self.rank_in is not None:
      carries = recv_tree(self._carry_specs(xs), self.comm, self.rank_in)
    finals, ys = [], xs
    for layer, carry in zip(self.layers, carries, strict=True):
      carry, ys = layer(ys, initial_carry=carry, return_carry=True, seq_lengths=seq_lengths)
      finals.append(carry)
    delegate = None
    if self.rank_out is not None:
      delegate = (send_tree(finals, self.comm, self.rank_out) if messages
                  else jnp.zeros((), jnp.float32))
    return tuple(finals), ys, delegate
