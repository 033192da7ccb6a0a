"""mnjax.model_parallel.MultiNodeNStepRNN (ChainerMN's create_multi_node_n_step_rnn): one
sequence run over a chain of ranks, each rank its own stretch and its own layers, the
carries passed along; the gradients equal the single-process model's.

Runs as one process and under mpirun -n 2 and -n 4 (tests/jobs/test_mpirun.py). Rank
r runs an LSTM layer then a GRU layer (carries: a tuple and an array) on time steps
[3r, 3r + 3) of the sequence, from rank r - 1's final carries, and sends its own to rank
r + 1; each rank's loss is its outputs' squared error. The reference runs every rank's
layers in one process, carry to carry, and differentiates the sum of the losses.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mnjax
from mnjax import functions as F

MultiNodeNStepRNN = mnjax.model_parallel.MultiNodeNStepRNN
STEPS, BATCH, FEATURES = 3, 2, 3
multi_rank = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                                reason="ranks that disagree need two ranks (runs under mpirun)")


def layers(hidden=4):
  return [nn.RNN(nn.LSTMCell(hidden)), nn.RNN(nn.GRUCell(hidden))]


def stretch(r):
  """Rank r's time steps of the sequence, (batch, time, features)."""
  t = jnp.arange(STEPS * BATCH * FEATURES, dtype=jnp.float32).reshape(BATCH, STEPS, FEATURES)
  return jnp.sin(0.1 * t + r)


def target(r):
  return jnp.cos(0.2 * jnp.arange(BATCH * STEPS * 4.0).reshape(BATCH, STEPS, 4) - r)


def rnn_of(comm, r, **kwargs):
  n = comm.size
  return MultiNodeNStepRNN(comm, layers(**kwargs), rank_in=r - 1 if r > 0 else None,
                           rank_out=r + 1 if r < n - 1 else None)


def params_of(comm, r):
  """Rank r's variables: the same in the distributed run and the reference (init sends
  nothing)."""
  return _init(comm, r)


def _init(comm, r):
  return jax.jit(MultiNodeNStepRNN(comm, layers()).init)(jax.random.key(r), stretch(r))


def run_layers(variables, xs, carries, seq_lengths):
  """The reference: rank r's layers in one process from the given carries."""
  finals, ys = [], xs
  for i, layer in enumerate(layers()):
    carry, ys = layer.apply({"params": variables["params"][f"layers_{i}"]}, ys,
                            initial_carry=carries[i], return_carry=True,
                            seq_lengths=seq_lengths)
    finals.append(carry)
  return finals, ys


def mse(ys, r):
  return jnp.mean((ys - target(r)) ** 2)


def test_a_sequence_over_the_ranks_equals_one_process(comm):
  """Values and every rank's gradients against one process, under plain jax.jit; a whole
  row and a row of 2 of the 3 steps (`seq_lengths`: its carry is taken at its last step)."""
  n, r = comm.size, comm.rank
  rnn = rnn_of(comm, r)
  seq_lengths = jnp.asarray((3, 2))
  wrap = jax.jit

  def loss(variables):
    carries, ys, delegate = rnn.apply(variables, stretch(r), seq_lengths)
    value = mse(ys, r)
    return (value if delegate is None else F.pseudo_connect(delegate, value)), carries

  (value, carries), grads = wrap(jax.value_and_grad(loss, has_aux=True))(params_of(comm, r))

  def whole(every):
    carries, total, values = [None, None], 0.0, []
    for s in range(n):
      carries, ys = run_layers(every[s], stretch(s), carries, seq_lengths)
      values.append(mse(ys, s))
      total += values[-1]
    return total, values

  every = [params_of(comm, s) for s in range(n)]
  (_, values), want = jax.jit(jax.value_and_grad(whole, has_aux=True))(every)
  np.testing.assert_allclose(value, values[r], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               grads, want[r])
  assert len(carries) == 2 and len(carries[0]) == 2  # the LSTM's (c, h), the GRU's h


def test_bad_peers_are_refused_when_built(comm):
  with pytest.raises(ValueError, match=f"rank_in={comm.size} is not a rank"):
    MultiNodeNStepRNN(comm, layers(), rank_in=comm.size)
  with pytest.raises(ValueError, match="rank_out=.* is this rank itself"):
    MultiNodeNStepRNN(comm, layers(), rank_out=comm.rank)
  with pytest.raises(TypeError, match="non-empty list of flax nn.RNN"):
    MultiNodeNStepRNN(comm, [nn.LSTMCell(4)])


@multi_rank
def test_carries_of_another_shape_are_refused_on_every_rank(comm):
  """Rank 1's layers are wider than rank 0's: the carries rank 0 sends are not what rank 1
  receives, and every rank raises before anything moves."""
  r = comm.rank
  rnn = rnn_of(comm, r, hidden=5 if r == 1 else 4)

  def loss(variables):
    _, ys, delegate = rnn.apply(variables, stretch(r))
    value = jnp.mean(ys ** 2)
    return value if delegate is None else F.pseudo_connect(delegate, value)

  variables = rnn.init(jax.random.key(r), stretch(r))
  with pytest.raises(F.ExchangeError, match="do not pair up"):
    jax.block_until_ready(F.jit(jax.grad(loss), comm)(variables))
