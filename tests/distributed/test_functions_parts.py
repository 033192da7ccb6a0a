"""mnjax.functions' collectives with a different shape on each rank (ChainerMN's variable
allgather, alltoall, gather and scatter): results and gradients against numpy, empty parts,
and tables or parts that differ across ranks refused on every rank before anything moves.

Runs as one process and under mpirun -n 2 and -n 4 (tests/jobs/test_mpirun.py). Rank
r's part has r rows (rank 0's is empty, as in ChainerMN's tests). Each rank differentiates
its own loss; the backward exchanges combine them, so rank r's gradient sums what every
rank's loss weighs its part with.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from mnjax import functions as F

JITS = pytest.mark.parametrize("jit", ["jax.jit", "functions.jit"])
multi_rank = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                                reason="ranks that disagree need two ranks (runs under mpirun)")


def wrap(jit, fn, comm):
  return jax.jit(fn) if jit == "jax.jit" else F.jit(fn, comm)


def value(s, shape):
  """Rank s's data of `shape`."""
  return (np.arange(np.prod(shape)).reshape(shape) + 100.0 * s).astype(np.float32)


def weight(s, i, shape):
  """The weight rank s's loss gives part i (of `shape`)."""
  return ((s + 1.0) * (np.arange(np.prod(shape)).reshape(shape) + 1) + i).astype(np.float32)


def rows(r):
  return (r, 3)


@JITS
def test_allgather_and_gather_with_per_rank_shapes(comm, jit):
  n, r = comm.size, comm.rank
  shapes = [rows(s) for s in range(n)]
  root = n - 1

  def losses(x):
    every = F.allgather(x, comm, shapes=shapes)
    at_root = F.gather(x, comm, root, shapes=shapes)
    loss = sum(jnp.sum(weight(r, i, shapes[i]) * p) for i, p in enumerate(every))
    if r == root:
      loss += sum(jnp.sum(weight(n + r, i, shapes[i]) * p) for i, p in enumerate(at_root))
    else:
      loss += at_root  # the delegate
    return loss, (every, at_root)

  grad, (every, at_root) = wrap(jit, jax.grad(losses, has_aux=True), comm)(value(r, rows(r)))

  assert [p.shape for p in every] == shapes
  for i, p in enumerate(every):
    np.testing.assert_array_equal(p, value(i, shapes[i]))
  if r == root:
    for i, p in enumerate(at_root):
      np.testing.assert_array_equal(p, value(i, shapes[i]))
  else:
    assert jnp.shape(at_root) == ()
  want = sum(weight(s, r, rows(r)) for s in range(n)) + weight(n + root, r, rows(r))
  np.testing.assert_allclose(grad, want)


@JITS
def test_scatter_of_parts(comm, jit):
  """The root hands out parts of per-rank shapes; the others name the shapes only."""
  n, r = comm.size, comm.rank
  root = n // 2
  shapes = [rows(s + 1) for s in range(n)]
  parts = ([jnp.asarray(value(s, shapes[s])) for s in range(n)] if r == root
           else [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])

  def loss(parts):
    mine = F.scatter(parts, comm, root)
    return jnp.sum(weight(r, r, shapes[r]) * mine), mine

  if r == root:
    grads, mine = wrap(jit, jax.grad(loss, has_aux=True), comm)(parts)
    for s, g in enumerate(grads):
      np.testing.assert_allclose(g, weight(s, s, shapes[s]))
  else:  # no array to differentiate: its gradient still goes back to the root

    def step(z):
      value, mine = loss(parts)
      return value + 0.0 * z, mine

    _, mine = wrap(jit, jax.grad(step, has_aux=True), comm)(0.0)
  np.testing.assert_array_equal(mine, value(r, shapes[r]))


@JITS
def test_alltoall_with_a_table(comm, jit):
  """shapes[i][j] = (i + j, 2): rank 0 sends itself an empty part."""
  n, r = comm.size, comm.rank
  table = [[(i + j, 2) for j in range(n)] for i in range(n)]
  xs = [jnp.asarray(value(n * r + j, table[r][j])) for j in range(n)]

  def loss(xs):
    got = F.alltoall(xs, comm, shapes=table)
    return sum(jnp.sum(weight(r, i, table[i][r]) * p) for i, p in enumerate(got)), got

  grads, got = wrap(jit, jax.grad(loss, has_aux=True), comm)(xs)
  for i, p in enumerate(got):
    np.testing.assert_array_equal(p, value(n * i + r, table[i][r]))
  for j, g in enumerate(grads):
    np.testing.assert_allclose(g, weight(j, r, table[r][j]))


def test_a_malformed_table_is_refused_at_once(comm):
  with pytest.raises(ValueError, match=f"shapes must be a list of {comm.size} shapes"):
    F.allgather(jnp.ones(2), comm, shapes=[(2,)] * (comm.size + 1))
  with pytest.raises(ValueError, match=r"shapes\[0\] must be a shape"):
    F.gather(jnp.ones(2), comm, 0, shapes=[(-1,)] * comm.size)
  with pytest.raises(ValueError, match="rows of"):
    F.alltoall([jnp.ones(2)] * comm.size, comm, shapes=[None] * comm.size)
  with pytest.raises(ValueError, match=f"a list of {comm.size} parts"):
    F.scatter([jnp.ones(2)] * (comm.size + 1), comm, 0)


@multi_rank
@JITS
def test_tables_that_differ_across_ranks_are_refused_on_every_rank(comm, jit):
  """Rank 1 believes rank 0's part has 2 rows, the others 1: the slots are the same size,
  so only the table tells them apart; every rank raises before anything moves."""
  n, r = comm.size, comm.rank
  shapes = [(2 if r == 1 else 1, 3)] + [(2, 3)] * (n - 1)
  x = jnp.ones(shapes[r])
  with pytest.raises(F.ExchangeError, match="per-rank shapes"):
    jax.block_until_ready(wrap(jit, lambda x: F.allgather(x, comm, shapes=shapes), comm)(x))


@multi_rank
@JITS
def test_a_part_that_is_not_its_table_entry_is_refused_on_every_rank(comm, jit):
  n, r = comm.size, comm.rank
  shapes = [(2,)] * n
  x = jnp.ones(3 if r == n - 1 else 2)
  with pytest.raises(F.ExchangeError, match=f"rank {n - 1}'s x has shape \\(3,\\)"):
    jax.block_until_ready(wrap(jit, lambda x: F.allgather(x, comm, shapes=shapes), comm)(x))
