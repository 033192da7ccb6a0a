"""The same batches on every rank: ChainerMN's multi-node and synchronized iterators.

After ChainerMN's iterators_tests: every rank's batch equals the master's at every step,
with batches that divide the data and batches that do not (a shorter last batch), a master
other than rank 0, the end reached on every rank at the same step, and a batch of the wrong
type refused (TypeError) on every rank; the synchronized iterator gives every rank the same
shuffled order, from a shared seed.
"""

import numpy as np
import pytest

import mnjax

N = 20


def master_batches(batch_size):
  """(x, y) pairs, float32 and int32, as ChainerMN's paired dataset; the last one shorter."""
  x = np.arange(N, dtype=np.float32).reshape(N, 1) * np.ones(3, np.float32)
  order = np.random.default_rng(0).permutation(N)
  return [{"x": x[order[i:i + batch_size]], "y": order[i:i + batch_size].astype(np.int32)}
          for i in range(0, N, batch_size)]


@pytest.mark.parametrize("batch_size", [4, 7])
@pytest.mark.parametrize("master", ["first", "last"])
def test_every_rank_gets_the_masters_batches_and_stops_with_it(comm, batch_size, master):
  rank_master = 0 if master == "first" else comm.size - 1
  mine = master_batches(batch_size) if comm.rank == rank_master else None
  got = list(mnjax.data.create_multi_node_iterator(mine, comm, rank_master=rank_master))
  expected = master_batches(batch_size)
  assert len(got) == len(expected) == -(-N // batch_size)
  for batch, want in zip(got, expected):
    assert batch["x"].dtype == np.float32 and batch["y"].dtype == np.int32
    np.testing.assert_array_equal(batch["x"], want["x"])
    np.testing.assert_array_equal(batch["y"], want["y"])
  everyone = comm.mpi_comm.allgather([b["y"].tolist() for b in got])
  assert all(ys == everyone[0] for ys in everyone)


def test_what_the_master_cannot_send_is_named_on_every_rank(comm):
  with pytest.raises(TypeError, match="rank 0 \\(rank_master\\) must be an iterable"):
    mnjax.data.create_multi_node_iterator(None, comm)
  objects = [(np.zeros(2), object())] if comm.rank == 0 else None
  with pytest.raises(TypeError, match="a leaf of type object, not an array"):
    next(mnjax.data.create_multi_node_iterator(objects, comm))

  def failing():
    yield np.zeros(2)
    raise OSError("disk gone")

  it = mnjax.data.create_multi_node_iterator(failing() if comm.rank == 0 else None, comm)
  np.testing.assert_array_equal(next(it), np.zeros(2))
  with pytest.raises(RuntimeError, match="rank_master\\) raised OSError: disk gone"):
    next(it)
  with pytest.raises(ValueError, match=rf"rank_master must be a rank in \[0, {comm.size}\)"):
    mnjax.data.create_multi_node_iterator([], comm, rank_master=comm.size)


def test_a_master_that_differs_between_ranks_is_named(comm):
  if comm.size == 1:
    pytest.skip("needs several ranks to disagree")
  with pytest.raises(ValueError, match="rank_master 0 on rank 0, 1 on rank"):
    mnjax.data.create_multi_node_iterator([], comm, rank_master=min(comm.rank, 1))


@pytest.mark.parametrize("batch_size, drop_remainder", [(4, True), (7, False)])
def test_synchronized_batches_are_one_shuffled_order_on_every_rank(comm, batch_size,
                                                                  drop_remainder):
  for seed in (None, 3):
    epochs = []
    for epoch in range(2):
      batches = list(mnjax.data.create_synchronized_iterator(
          N, comm, batch_size, seed=seed, epoch=epoch, drop_remainder=drop_remainder))
      idx = np.concatenate([i[m] for i, m in batches])
      assert len(batches) == (N // batch_size if drop_remainder else -(-N // batch_size))
      assert len(set(idx.tolist())) == len(idx)            # no example twice in an epoch
      assert drop_remainder or sorted(idx.tolist()) == list(range(N))
      assert idx.tolist() != sorted(idx.tolist())          # shuffled
      everyone = comm.mpi_comm.allgather(idx.tolist())
      assert all(order == everyone[0] for order in everyone)
      epochs.append(idx.tolist())
    assert epochs[0] != epochs[1]                          # a new order per epoch
  again = np.concatenate([i[m] for i, m in mnjax.data.create_synchronized_iterator(
      N, comm, batch_size, seed=3, epoch=1, drop_remainder=drop_remainder)])
  assert again.tolist() == epochs[1]                       # reproducible from the seed


def test_synchronized_iterator_bad_input(comm):
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    mnjax.data.create_synchronized_iterator(N, comm, 0)
  if comm.size > 1:
    with pytest.raises(ValueError, match="seed 0 on rank 0, 1 on rank"):
      mnjax.data.create_synchronized_iterator(N, comm, 4, seed=min(comm.rank, 1))
