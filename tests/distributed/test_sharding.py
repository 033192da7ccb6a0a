"""scatter_index / scatter_dataset / epoch_batches: properties checked across real ranks."""

import numpy as np
import pytest

import mnjax


def gather(comm, value):
  return comm.mpi_comm.allgather(value)


@pytest.mark.parametrize("n", [10, 11, 97, 1438])
def test_equal_length_shards_cover_the_dataset(comm, n):
  shards = gather(comm, mnjax.scatter_index(n, comm, shuffle=True, seed=3, epoch=1))
  assert {len(s) for s in shards} == {-(-n // comm.size)}
  assert set(np.concatenate(shards)) == set(range(n))


@pytest.mark.parametrize("n", [10, 11, 97])
def test_unequal_shards_are_an_exact_partition(comm, n):
  shards = gather(comm, mnjax.scatter_index(n, comm, shuffle=True, force_equal_length=False))
  assert sorted(np.concatenate(shards).tolist()) == list(range(n))
  assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_mask_marks_duplicates_so_masked_union_is_a_partition(comm):
  n = 3 * comm.size + 1  # never divisible by size > 1: padding on some ranks
  idx, mask = mnjax.scatter_index(n, comm, shuffle=True, seed=1, return_mask=True)
  kept = gather(comm, idx[mask])
  assert sorted(np.concatenate(kept).tolist()) == list(range(n))
  padded = gather(comm, int((~mask).sum()))
  assert sum(padded) == -(-n // comm.size) * comm.size - n


def test_order_changes_with_epoch_and_is_reproducible_from_seed(comm):
  n = 200
  a = mnjax.scatter_index(n, comm, shuffle=True, seed=7, epoch=0)
  again = mnjax.scatter_index(n, comm, shuffle=True, seed=7, epoch=0)
  next_epoch = mnjax.scatter_index(n, comm, shuffle=True, seed=7, epoch=1)
  other_seed = mnjax.scatter_index(n, comm, shuffle=True, seed=8, epoch=0)
  np.testing.assert_array_equal(a, again)
  assert not np.array_equal(a, next_epoch)
  assert not np.array_equal(a, other_seed)
  # Identical permutation everywhere: rank 0's view of the global order matches all ranks'.
  orders = gather(comm, np.concatenate(gather(comm, a)))
  for order in orders[1:]:
    np.testing.assert_array_equal(order, orders[0])


def test_scatter_dataset_arrays_and_sequences(comm):
  n = 5 * comm.size + 2
  x = np.arange(n * 3).reshape(n, 3)
  y = np.arange(n)
  xs, ys = mnjax.scatter_dataset((x, y), comm, shuffle=True, seed=2)
  np.testing.assert_array_equal(xs[:, 0] // 3, ys)  # rows stay paired
  np.testing.assert_array_equal(ys, mnjax.scatter_index(n, comm, shuffle=True, seed=2))
  words = [f"w{i}" for i in range(n)]
  sub = mnjax.scatter_dataset(words, comm)
  assert [sub[i] for i in range(len(sub))] == [words[i] for i in mnjax.scatter_index(n, comm)]


def test_epoch_batches_same_step_count_everywhere_and_exact_eval_coverage(comm):
  n, global_batch = 101, 8 * comm.size
  train_steps = gather(comm, len(list(mnjax.epoch_batches(n, comm, global_batch, shuffle=True))))
  assert len(set(train_steps)) == 1 and train_steps[0] >= 1
  seen = []
  for idx, mask in mnjax.epoch_batches(n, comm, global_batch, shuffle=False, drop_remainder=False):
    assert len(idx) == global_batch // comm.size  # one static shape
    seen.extend(idx[mask].tolist())
  assert sorted(sum(gather(comm, seen), [])) == list(range(n))
