"""mnjax.model_parallel.MultiNodeChain as a graph: stages with several inputs, a stage taken
by several, pytree activations, a rank that runs several stages and a rank that runs none.

Runs as one process and under mpirun -n 2 and -n 4 (tests/jobs/test_mpirun.py,
`test_model_parallel_under_mpirun_4`; not at 3). Stages sit on ``rank % comm.size``, so every size
runs the same model: the gradients of every rank's stages equal the whole model's in one
process (`apply_all`), whatever the placement.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mnjax
from mnjax import functions as F

MultiNodeChain = mnjax.model_parallel.MultiNodeChain
X = jnp.linspace(-1.0, 1.0, 4 * 5).reshape(4, 5)
Y = jnp.linspace(0.5, -0.5, 4 * 2).reshape(4, 2)
multi_rank = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                                reason="ranks that disagree need two ranks (runs under mpirun)")


class Fork(nn.Module):
  """x -> (a, b): a tuple activation."""

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4)(x)), nn.Dense(3)(x)


class Pair(nn.Module):
  """(a, b) -> h: takes a tuple, unpacked into two arguments."""

  @nn.compact
  def __call__(self, a, b):
    return jnp.tanh(nn.Dense(4)(a)) + nn.Dense(4)(b)


class Branch(nn.Module):
  """x -> {"h": float, "sign": int}: a dict activation with an integer leaf."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    return {"h": h, "sign": (h > 0).astype(jnp.int32)}


class Join(nn.Module):
  """((a, b), {"h", "sign"}) -> h: two inputs, one of them a tuple kept whole."""

  @nn.compact
  def __call__(self, fork, branch):
    a, b = fork
    return nn.Dense(4)(a * branch["h"]) + jnp.sum(b, axis=-1, keepdims=True) * branch["sign"]


class Head(nn.Module):
  @nn.compact
  def __call__(self, h1, h3):
    return nn.Dense(2)(h1 + h3)


# (module, rank, inputs): stage 0 is taken by stages 1 and 3 (ChainerMN's rank_out list),
# stages 3 and 4 take two inputs each (rank_in lists), stage 2 takes the model's input.
# Ranks mod the size: at 2 ranks 0,1,0,1,0; at 3 ranks 0,1,2,1,0; at 4 rank 3 runs nothing.
GRAPH = [(Fork(), 0, None), (Pair(), 1, 0), (Branch(), 2, None), (Join(), 1, (0, 2)),
         (Head(), 0, (1, 3))]


def mse(out, target):
  return jnp.mean((out - target) ** 2)


def graph(comm, **kwargs):
  return MultiNodeChain(comm, [(m, r % comm.size, i) for m, r, i in GRAPH], **kwargs)


def own(chain, everything):
  return {f"stage_{s}": everything[f"stage_{s}"] for s in chain.own_stages}


def assert_close(got, want):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


@pytest.mark.parametrize("jit", ["jax.jit", "functions.jit"])
def test_a_graph_over_the_ranks_equals_the_whole_model(comm, jit):
  """Every rank's stages' gradients, and the loss and output on the output rank, equal the
  whole model's in one process; a rank without a stage returns its delegate."""
  chain = graph(comm)
  everything = chain.init_all(jax.random.key(0), X)
  params = own(chain, everything)
  assert sorted(params) == [f"stage_{s}" for s in range(5) if GRAPH[s][1] % comm.size
                            == comm.rank]
  wrap = jax.jit if jit == "jax.jit" else (lambda fn: F.jit(fn, comm))

  loss, grads = wrap(jax.value_and_grad(lambda p: chain.loss(p, X, Y, mse)))(params)
  out = wrap(chain.apply)(params, X)

  want_loss, want = jax.value_and_grad(lambda p: mse(chain.apply_all(p, X), Y))(everything)
  assert sorted(grads) == sorted(params)
  assert_close(grads, own(chain, want))
  if comm.rank == chain.output_rank:
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(out, chain.apply_all(everything, X), rtol=1e-6, atol=1e-7)
  else:
    assert jnp.shape(out) == ()


def test_a_piped_chain_splits_a_pytree_batch(comm):
  """GPipe (2 micro-batches) over a chain whose input and target are dicts: the mean of the
  micro-batches' losses and its gradients equal the whole batch's (each micro-batch's mean
  is over equal halves)."""

  class Take(nn.Module):
    @nn.compact
    def __call__(self, batch):
      return jnp.tanh(nn.Dense(4)(batch["image"]) + batch["bias"])

  ranks = [min(s, comm.size - 1) for s in range(3)]
  stages = [(Take(), ranks[0]), (nn.Dense(4), ranks[1]), (nn.Dense(2), ranks[2])]
  chain = MultiNodeChain(comm, stages, micro_batches=2)
  batch = {"image": X, "bias": jnp.arange(4.0)[:, None] / 4}
  target = {"y": Y}

  def loss(out, t):
    return mse(out, t["y"])

  everything = chain.init_all(jax.random.key(1), batch)
  params = own(chain, everything)
  value, grads = jax.jit(jax.value_and_grad(lambda p: chain.loss(p, batch, target, loss)))(
      params)
  want_value, want = jax.value_and_grad(lambda p: loss(chain.apply_all(p, batch), target))(
      everything)
  assert_close(grads, own(chain, want))
  if comm.rank == chain.output_rank:
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
  with pytest.raises(ValueError, match=r"leading axis \(\(3,\)\) must divide by"):
    chain.loss(params, {"image": X, "bias": jnp.zeros(3)}, target, loss)


@pytest.mark.parametrize("stages, match", [
    ([(nn.Dense(2), 0, 1), (nn.Dense(2), 0)], "takes 1 as an input; an input is None"),
    ([(nn.Dense(2), 0, ()), (nn.Dense(2), 0)], "stage 0 takes no input"),
    ([(nn.Dense(2), 0), (nn.Dense(2), 0, None)], "the output of stage 0 goes nowhere"),
    ([(nn.Dense(2), 0), (nn.Dense(2), 0, True)], "takes True as an input"),
])
def test_a_bad_graph_is_refused_when_built(comm, stages, match):
  with pytest.raises(ValueError, match=match):
    MultiNodeChain(comm, stages)


def test_gpipe_needs_a_chain(comm):
  with pytest.raises(ValueError, match="micro_batches=2 \\(GPipe\\) runs over a chain"):
    graph(comm, micro_batches=2)


@multi_rank
def test_ranks_that_build_different_graphs_are_refused_on_every_rank(comm):
  """One rank gives stage 1 another input: every rank raises, naming both graphs, before
  any message."""
  stages = [(nn.Dense(4), 0), (nn.Dense(4), 1 % comm.size, None if comm.rank == 1 else 0),
            (nn.Dense(2), 0, (0, 1))]
  with pytest.raises(ValueError, match="the ranks built different chains"):
    MultiNodeChain(comm, stages)
