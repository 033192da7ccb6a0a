"""`create_empty_dataset`: a dataset for the ranks of a multi-node model that take no input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mnjax.data._scatter import dataset_length

__all__ = ["EmptyDataset", "create_empty_dataset"]


class EmptyDataset(Sequence):
  """`length` examples, each ``()``; a slice or an index array gives another one.

  Example:
    >>> empty = EmptyDataset(3)
    >>> len(empty), empty[2], len(empty[np.array([0, 0, 1, 2])])
    (3, (), 4)
  """

  def __init__(self, length: int):
    self.length = int(length)

  def __len__(self) -> int:
    return self.length

  def __repr__(self) -> str:
    return f"EmptyDataset({self.length})"

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, EmptyDataset) and other.length == self.length

  __hash__ = None  # mutable attribute, like a list

  def __getitem__(self, i: Any):
    if isinstance(i, slice):
      return EmptyDataset(len(range(*i.indices(self.length))))
    if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
      if not -self.length <= i < self.length:
        raise IndexError(f"EmptyDataset index {i} out of range for {self.length} examples.")
      return ()
    idx = np.asarray(i)
    if idx.dtype == np.bool_ and idx.shape == (self.length,):
      return EmptyDataset(int(idx.sum()))
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
      raise TypeError("EmptyDataset: index with an int, a slice, or a 1-D int or bool array,"
                      f" got {type(i).__name__} of dtype {idx.dtype}, shape {idx.shape}.")
    if idx.size and not (-self.length <= idx.min() and idx.max() < self.length):
      raise IndexError(f"EmptyDataset: indices outside [0, {self.length}).")
    return EmptyDataset(idx.size)


def create_empty_dataset(dataset: Any) -> EmptyDataset:
  """An `EmptyDataset` as long as `dataset` (as `mnjax.scatter_dataset` takes it); ChainerMN's.

  For the ranks that take no input, so every rank runs the same steps. Local.

  Example:
    >>> images = np.zeros((10, 8, 8, 1))
    >>> empty = mnjax.data.create_empty_dataset((images, np.arange(10)))
    >>> len(empty), empty[0]
    (10, ())
    >>> for idx, _ in mnjax.epoch_batches(len(empty), comm, 2 * comm.size, shuffle=True):
    ...   batch = empty[idx]                   # e.g. on a rank whose stage starts with recv
    >>> len(batch)
    2
  """
  n, _ = dataset_length(dataset, "create_empty_dataset")
  return EmptyDataset(n)
