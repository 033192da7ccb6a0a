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


# The training order. A grouping is (processes, devices per process); replica
# j = rank * devices + device. What the step sees of a global batch is the ranks' slices in
# rank order, each split over its devices in order: rank-major, then device-major.
GROUPINGS = [(4, 1), (2, 2), (1, 4), (8, 1), (2, 4)]


def as_the_step_sees_it(n, global_batch, processes, devices, **options):
  """Per step, the replicas' examples in replica order, and the masks likewise."""
  replicas_idx, replicas_mask = [], []
  for rank in range(processes):
    idx, mask = mnjax.data.global_batch_slices(n, global_batch, rank=rank, size=processes,
                                               **options)
    assert idx.shape == mask.shape == (idx.shape[0], global_batch // processes)
    replicas_idx += np.split(idx, devices, axis=1)  # the process's devices, in order
    replicas_mask += np.split(mask, devices, axis=1)
  return np.stack(replicas_idx, axis=1), np.stack(replicas_mask, axis=1)


@pytest.mark.parametrize("drop_remainder", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [83, 96])
def test_global_batches_do_not_depend_on_how_replicas_group_into_processes(n, drop_remainder):
  global_batch = 16
  options = dict(shuffle=drop_remainder, seed=5, epoch=2, drop_remainder=drop_remainder)
  seen = {g: as_the_step_sees_it(n, global_batch, *g, **options) for g in GROUPINGS}
  reference_idx, reference_mask = seen[GROUPINGS[0]]
  steps = n // global_batch if drop_remainder else -(-n // global_batch)
  assert reference_idx.shape == (steps, 4, global_batch // 4)
  for idx, mask in seen.values():  # replica j sees the same examples in every grouping
    replicas = idx.shape[1]
    np.testing.assert_array_equal(idx.reshape(steps, -1), reference_idx.reshape(steps, -1))
    np.testing.assert_array_equal(mask.reshape(steps, -1), reference_mask.reshape(steps, -1))
    per_replica = global_batch // replicas
    for j in range(replicas):
      np.testing.assert_array_equal(
          idx[:, j], reference_idx.reshape(steps, -1)[:, j * per_replica:(j + 1) * per_replica])
  # And that order is the epoch's permutation cut into consecutive global batches.
  one, one_mask = mnjax.data.global_batch_slices(n, global_batch, rank=0, size=1, **options)
  np.testing.assert_array_equal(reference_idx.reshape(steps, -1), one)
  flat = one[one_mask]
  assert len(flat) == len(set(flat.tolist())) == (steps * global_batch if drop_remainder else n)
  if not drop_remainder:
    assert sorted(flat.tolist()) == list(range(n))


def test_global_batch_slices_checks_its_arguments():
  with pytest.raises(ValueError, match="multiple of the 3 processes"):
    mnjax.data.global_batch_slices(100, 16, rank=0, size=3, shuffle=True)
  with pytest.raises(ValueError, match="0 <= rank < size"):
    mnjax.data.global_batch_slices(100, 16, rank=2, size=2, shuffle=True)
  with pytest.raises(ValueError, match="no full global batch of 16"):
    mnjax.data.global_batch_slices(10, 16, rank=0, size=2, shuffle=True)
  idx, mask = mnjax.data.global_batch_slices(10, 16, rank=1, size=2, shuffle=True,
                                             drop_remainder=False)
  assert idx.shape == (1, 8) and mask.tolist() == [[True, True] + [False] * 6]


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_replicas_see_one_process_global_batches_under_any_grouping(comm, kind):
  """Under mpirun -n P: flat is P x 1 and hierarchical P x 2 (conftest's two CPU devices);
  the step's per-device inputs, gathered over ranks, are one process's global batches."""
  from mnjax.train._parallel import data_parallel  # the step the loops feed

  kc = mnjax.create_communicator(kind)
  n, global_batch = 11 * comm.size + 5, 4 * comm.size * 2  # divisible for both groupings
  see = data_parallel(lambda idx: (idx,), kc, batch_argnums=(0,), per_device_outputs=(0,))
  one = mnjax.data.global_batch_slices(n, global_batch, rank=0, size=1, shuffle=True, seed=4,
                                       epoch=1, drop_remainder=False)
  batches = mnjax.epoch_batches(n, kc, global_batch, shuffle=True, seed=4, epoch=1,
                                drop_remainder=False)
  steps = 0
  for (idx, mask), expected, expected_mask in zip(batches, *one):
    (devices,) = see(idx.astype(np.int32))  # one row per local device, in device order
    assert np.shape(devices) == (kc.local_device_count, global_batch // kc.num_replicas)
    np.testing.assert_array_equal(np.concatenate(gather(comm, np.asarray(devices).reshape(-1))),
                                  expected)
    np.testing.assert_array_equal(np.concatenate(gather(comm, mask)), expected_mask)
    steps += 1
  assert steps == len(one[0]) == -(-n // global_batch)


def test_an_empty_dataset_scatters_to_empty_shards_but_is_refused_for_batches(comm):
  # ChainerMN scatters an empty dataset (empty shards); a training loop must not run on it.
  idx, mask = mnjax.scatter_index(0, comm, return_mask=True)
  assert idx.shape == mask.shape == (0,) and idx.dtype == np.int64 and mask.dtype == bool
  assert mnjax.scatter_index(0, comm, force_equal_length=False).shape == (0,)
  assert len(mnjax.scatter_dataset([], comm)) == 0
  assert mnjax.scatter_dataset(np.array([]), comm).shape == (0,)
  for drop_remainder in (True, False):
    with pytest.raises(ValueError, match=r"the dataset is empty \(0 examples\)") as error:
      mnjax.epoch_batches(0, comm, comm.size, shuffle=True, drop_remainder=drop_remainder)
    assert "at most" not in str(error.value)


# ChainerMN's split (chainermn/datasets/scatter.py), restated from its documented semantics:
# equal length: rank r reads ceil(n / size) examples from floor(n * r / size) on (the short
# ranks' last ones are the next rank's first: duplicates); otherwise an exact partition in
# rank order, the first n % size ranks one example more.
def chainermn_bounds(n, rank, size, force_equal_length):
  if force_equal_length:
    begin = n * rank // size
    return begin, begin + -(-n // size)
  q, rem = divmod(n, size)
  begin = rank * q + min(rank, rem)
  return begin, begin + q + (rank < rem)


def test_scatter_index_ten_over_three_gives_the_remainder_to_the_first_ranks():
  bounds = [mnjax.data.shard_bounds(10, r, 3, force_equal_length=False)[:2]
            for r in range(3)]
  assert bounds == [(0, 4), (4, 7), (7, 10)]  # ChainerMN's test_scatter_index_one


@pytest.mark.parametrize("n,size", [(10, 3), (1244, 23), (2, 1), (230945, 237), (0, 3), (1, 2),
                                    (5, 3), (11, 4), (3, 7)])
@pytest.mark.parametrize("force_equal_length", [True, False])
def test_shard_bounds_are_chainermn_for_every_rank(n, size, force_equal_length):
  kept = []
  for rank in range(size):
    begin, end, real_end = mnjax.data.shard_bounds(n, rank, size,
                                                              force_equal_length=force_equal_length)
    assert (begin, end) == chainermn_bounds(n, rank, size, force_equal_length)
    assert begin <= real_end <= end <= n
    kept.extend(range(begin, real_end))
  assert kept == list(range(n))  # the unmasked part: every example once, in order


@pytest.mark.parametrize("n", [0, 1, 2, 10, 11, 97])
@pytest.mark.parametrize("force_equal_length", [True, False])
def test_scatter_index_is_chainermns_split_on_real_ranks(comm, n, force_equal_length):
  idx, mask = mnjax.scatter_index(n, comm, force_equal_length=force_equal_length,
                                  return_mask=True)
  begin, end = chainermn_bounds(n, comm.rank, comm.size, force_equal_length)
  assert idx.tolist() == list(range(begin, end))
  kept = gather(comm, idx[mask].tolist())
  assert sorted(sum(kept, [])) == list(range(n))  # the mask leaves each example once
  if not force_equal_length:
    assert mask.all()  # an exact partition: nothing is padding


@pytest.mark.parametrize("shuffle", [False, True])
def test_scatter_dataset_as_chainermns_own_test_checks_it(comm, shuffle):
  # chainermn_tests/datasets_tests/test_scatter.py: equal sizes, n <= size * shard <
  # n + size, and the shards' union is the dataset, for [], [0], range(size), range(5 size - 1).
  for n in (0, 1, comm.size, 5 * comm.size - 1):
    for data in (list(range(n)), np.arange(n), np.arange(n, dtype=np.float32)):
      mine = mnjax.scatter_dataset(data, comm, shuffle=shuffle, seed=0)
      shards = gather(comm, [int(mine[i]) for i in range(len(mine))])
      (length,) = {len(s) for s in shards}
      assert length * comm.size >= n > (length - 1) * comm.size
      assert set(sum(shards, [])) == set(range(n))


def test_one_example_over_several_ranks_is_duplicated_and_masked(comm):
  shard, mask = mnjax.scatter_dataset(["only"], comm, return_mask=True)
  assert list(shard) == ["only"] and mask.shape == (1,)
  assert sum(gather(comm, int(mask.sum()))) == 1  # counted once over all ranks
  (xs, ys), mask = mnjax.scatter_dataset((np.ones((1, 3)), np.arange(1)), comm, return_mask=True)
  assert xs.shape == (1, 3) and ys.tolist() == [0] and mask.shape == (1,)
  exact = mnjax.scatter_dataset(["only"], comm, force_equal_length=False)
  assert gather(comm, len(exact)) == [1] + [0] * (comm.size - 1)  # the first rank has it


def test_evaluation_batches_of_fewer_examples_than_ranks_are_masked(comm):
  seen = [idx[mask].tolist() for idx, mask in
          mnjax.epoch_batches(1, comm, comm.size, shuffle=False, drop_remainder=False)]
  assert len(seen) == 1 and sorted(sum(sum(gather(comm, seen), []), [])) == [0]
  if comm.size > 1:  # training on it: no full global batch, said on every rank
    with pytest.raises(ValueError, match="1 examples make no full global batch"):
      mnjax.epoch_batches(1, comm, comm.size, shuffle=True)
