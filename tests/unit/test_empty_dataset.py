"""create_empty_dataset: as long as the dataset, every example () (ChainerMN's semantics).

The cases of ChainerMN's datasets_tests/test_empty_dataset.py, plus what mnjax's batches
need: index arrays, slices and pytrees of arrays.
"""

import numpy as np
import pytest

import mnjax

N = 10


@pytest.mark.parametrize("dataset", [[], [0], list(range(N)), list(range(N * 5 - 1)),
                                     np.array([]), np.array([0]), np.arange(N),
                                     np.arange(N * 5 - 1)],
                         ids=lambda d: f"{type(d).__name__}{len(d)}")
def test_same_length_and_every_example_empty(dataset):
  empty = mnjax.data.create_empty_dataset(dataset)
  assert len(empty) == len(dataset)
  assert [empty[i] for i in range(len(dataset))] == [()] * len(dataset)
  assert list(empty) == [()] * len(dataset)


def test_pytrees_index_arrays_and_slices():
  empty = mnjax.data.create_empty_dataset({"x": np.zeros((7, 2)), "y": np.arange(7)})
  assert len(empty) == 7 and empty[-1] == ()
  assert empty[np.array([6, 0, 0])] == mnjax.data.EmptyDataset(3)
  assert len(empty[2:]) == 5 and len(empty[::3]) == 3
  assert len(empty[np.arange(7) % 2 == 0]) == 4          # a boolean mask
  with pytest.raises(IndexError):
    empty[7]
  with pytest.raises(IndexError):
    empty[np.array([0, 7])]
  with pytest.raises(TypeError, match="index with an int"):
    empty[np.zeros((2, 2), int)]


def test_bad_input_is_named():
  with pytest.raises(TypeError, match="create_empty_dataset: expected an array"):
    mnjax.data.create_empty_dataset(None)
  with pytest.raises(ValueError, match="same number of examples"):
    mnjax.data.create_empty_dataset((np.zeros(3), np.zeros(4)))
