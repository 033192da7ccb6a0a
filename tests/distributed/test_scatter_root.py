"""scatter_dataset(..., root=r): only rank r holds the data (ChainerMN's scatter_dataset).

`test_chainermns_own_test` is ChainerMN's datasets_tests/test_scatter.py::test_scatter_dataset
(every root, shuffled or not, lists and arrays of 0, 1, size and 5 * size - 1 examples; the
other ranks pass None); the others pin that the shards are those of the every-rank path.
"""

import numpy as np
import pytest

import mnjax


def datasets(size):
  return [[], [0], list(range(size)), list(range(size * 5 - 1)),
          np.array([]), np.array([0]), np.arange(size), np.arange(size * 5 - 1)]


def test_chainermns_own_test(comm):
  for shuffle in (True, False):
    for root in range(comm.size):
      for original in datasets(comm.size):
        mine = mnjax.scatter_dataset(original if comm.rank == root else None, comm, root=root,
                                     shuffle=shuffle, seed=5)
        subs = comm.mpi_comm.allgather(list(mine))
        sizes = {len(sub) for sub in subs}
        assert len(sizes) == 1
        sub_size = sizes.pop()
        assert len(original) <= sub_size * comm.size
        assert len(original) > (sub_size - 1) * comm.size
        assert {int(e) for sub in subs for e in sub} == {int(e) for e in original}


@pytest.mark.parametrize("force_equal_length", [True, False])
def test_the_shards_are_those_of_every_rank_holding_the_data(comm, force_equal_length):
  n = 4 * comm.size + 1
  x, y = np.arange(n * 2, dtype=np.float32).reshape(n, 2), np.arange(n)
  options = dict(shuffle=True, seed=3, epoch=2, force_equal_length=force_equal_length,
                 return_mask=True)
  root = comm.size - 1
  (xr, yr), mask = mnjax.scatter_dataset((x, y) if comm.rank == root else None, comm,
                                         root=root, **options)
  (xe, ye), mask_e = mnjax.scatter_dataset((x, y), comm, **options)
  np.testing.assert_array_equal(xr, xe)
  np.testing.assert_array_equal(yr, ye)
  np.testing.assert_array_equal(mask, mask_e)
  words = [f"w{i}" for i in range(n)]
  got = mnjax.scatter_dataset(words if comm.rank == 0 else None, comm, root=0, **options)[0]
  assert got == list(mnjax.scatter_dataset(words, comm, **options)[0])
  kept = comm.mpi_comm.allgather(yr[mask].tolist())
  assert sorted(sum(kept, [])) == list(range(n))  # masked: each example once


def test_what_the_root_cannot_scatter_is_named_on_every_rank(comm):
  with pytest.raises(TypeError, match="rank 0, the root, which alone holds the data"):
    mnjax.scatter_dataset(None, comm, root=0)
  ragged = (np.zeros(3), np.zeros(4)) if comm.rank == 0 else None
  with pytest.raises(ValueError, match="same number of examples"):
    mnjax.scatter_dataset(ragged, comm, root=0)
  with pytest.raises(ValueError, match=rf"root must be None .* or a rank in \[0, {comm.size}\)"):
    mnjax.scatter_dataset([1, 2], comm, root=comm.size)


def test_ranks_that_disagree_are_named_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip("needs several ranks to disagree")
  with pytest.raises(ValueError, match="root 0 on rank 0, 1 on rank"):
    mnjax.scatter_dataset([1, 2], comm, root=min(comm.rank, 1))
  # every rank holding the data, but one holds none: named on every rank, with root= as a fix
  held = None if comm.rank == 1 else [1, 2]
  with pytest.raises(ValueError, match=r"not a dataset \(NoneType\) on rank 1.*pass root="):
    mnjax.scatter_dataset(held, comm)
