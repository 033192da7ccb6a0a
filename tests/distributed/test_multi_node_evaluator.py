"""generic_multi_node_evaluator: per-batch results of every rank, aggregated on the root.

ChainerMN's extensions_tests/test_multi_node_evaluator.py, translated: each rank holds
``range(rank, length, size)`` (uneven shards), a model ``a + b + c``; the results come to the
root in ChainerMN's order (round by round, rank by rank), the other ranks get None; a custom
``calc_local``/``aggregate`` counts the batches of every rank.
"""

import numpy as np
import pytest

import mnjax


def batches(comm, length, batch_size):
  a = np.arange(comm.rank, length, comm.size)
  return [(a[i:i + batch_size], a[i:i + batch_size], a[i:i + batch_size])
          for i in range(0, len(a), batch_size)]


@pytest.mark.parametrize("length, batch_size", [(97, 7), (9, 77)])
def test_generic(comm, length, batch_size):
  evaluator = mnjax.train.generic_multi_node_evaluator(comm, lambda a, b, c: a + b + c)
  results = evaluator(batches(comm, length, batch_size))
  everyone = comm.mpi_comm.allgather([a + b + c for a, b, c in batches(comm, length,
                                                                        batch_size)])
  expected = [mine[k] for k in range(max(map(len, everyone))) for mine in everyone
              if k < len(mine)]
  if comm.rank == 0:
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
      np.testing.assert_array_equal(got, want)
    assert sorted(np.concatenate(results).tolist()) == [3 * i for i in range(length)]
  else:
    assert results is None


@pytest.mark.parametrize("length, batch_size", [(97, 7), (9, 77)])
def test_custom(comm, length, batch_size):
  def calc_local(*args):
    assert len(args) == 3
    return 2

  def aggregate(results):
    assert all(r == 2 for r in results)
    return sum(results)

  evaluator = mnjax.train.generic_multi_node_evaluator(comm, calc_local, aggregate, root=None)
  expected = 2 * sum(comm.mpi_comm.allgather(len(batches(comm, length, batch_size))))
  assert evaluator(batches(comm, length, batch_size)) == expected  # root=None: every rank


def test_a_failing_rank_is_named_on_every_rank(comm):
  def calc_local(x):
    if x == comm.size - 1:
      raise ValueError("bad batch")
    return x

  evaluator = mnjax.train.generic_multi_node_evaluator(comm, calc_local)
  with pytest.raises(RuntimeError, match=f"failed on 1 of {comm.size}.*rank {comm.size - 1}:"
                     " ValueError: bad batch"):
    evaluator([comm.rank])
  with pytest.raises(TypeError, match="calc_local must be callable"):
    mnjax.train.generic_multi_node_evaluator(comm, None)
  with pytest.raises(ValueError, match=rf"root must be a rank in \[0, {comm.size}\)"):
    mnjax.train.generic_multi_node_evaluator(comm, calc_local, root=-1)
  if comm.size > 1:
    with pytest.raises(ValueError, match="every rank must pass the same root"):
      mnjax.train.generic_multi_node_evaluator(comm, calc_local, root=min(comm.rank, 1))
