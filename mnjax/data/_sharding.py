"""Which examples each rank reads, and in what order (docs/design/data.md): every rank draws
the same permutation from ``(seed, epoch)`` and takes its part of it.

Example:
  >>> idx, mask = mnjax.data.global_batch_slices(8, 4, rank=1, size=2, shuffle=False)
  >>> idx.tolist()                     # rank 1's half of global batches [0..3] and [4..7]
  [[2, 3], [6, 7]]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.data._agreement import check_same_plan

__all__ = [
    "SubDataset",
    "epoch_batches",
    "global_batch_slices",
    "local_batch_size",
    "scatter_index",
    "shard_bounds",
    "shard_indices",
]


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_size(n: Any, caller: str) -> int:
  if not _is_int(n) or n < 0:
    raise TypeError(f"{caller}: the dataset size must be a non-negative int, got {n!r}.")
  return int(n)


def _check_n(n: Any, caller: str) -> int:
  """The dataset size of something that runs steps on it: at least one example."""
  n = _check_size(n, caller)
  if n == 0:
    raise ValueError(
        f"{caller}: the dataset is empty (0 examples), so no rank has anything to read."
        " Check that the data was found and loaded (its path, its split, any filter"
        " applied before this call).")
  return n


def _permutation(n: int, shuffle: bool, seed: Any, epoch: Any, caller: str) -> np.ndarray:
  """The epoch's example order, identical on every rank: a function of (seed, epoch) only."""
  if not shuffle:
    return np.arange(n)
  for name, value in (("seed", seed), ("epoch", epoch)):
    if not _is_int(value) or value < 0:
      raise TypeError(f"{caller}: {name} must be a non-negative int (the same on every rank),"
                      f" got {value!r}.")
  return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


def _order_values(n: Any, shuffle: bool, seed: Any, epoch: Any) -> dict[str, Any]:
  """What decides the epoch's permutation (the seed and epoch only when it is shuffled)."""
  values = {"dataset size": n, "shuffle": shuffle}
  return values | ({"seed": seed, "epoch": epoch} if shuffle else {})


def shard_bounds(n: int, rank: int, size: int, *,
                 force_equal_length: bool) -> tuple[int, int, int]:
  """ChainerMN's block of rank `rank` of `size`: positions ``[begin, end)`` of the
  permutation, of which ``[begin, real_end)`` are this rank's own (the rest: duplicates).

  Example:
    >>> [shard_bounds(10, r, 3, force_equal_length=False)[:2] for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    >>> [shard_bounds(5, r, 3, force_equal_length=True) for r in range(3)]
    [(0, 2, 1), (1, 3, 3), (3, 5, 5)]
  """
  if force_equal_length:
    begin = n * rank // size
    return begin, begin + -(-n // size), n * (rank + 1) // size
  q, rem = divmod(n, size)
  begin = rank * q + min(rank, rem)
  end = begin + q + (rank < rem)
  return begin, end, end


def scatter_index(
    n: int,
    comm: Communicator,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    force_equal_length: bool = True,
    return_mask: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
  """This rank's contiguous block of indices into a dataset of `n` examples (ChainerMN's).

  Collective: the arguments must match on every rank. ``force_equal_length``: ``ceil(n /
  size)`` indices each, a short block ending with the next rank's first ones; False: an
  exact partition. ``return_mask``: also a bool array, False on duplicates.

  Example:
    >>> x, y = np.arange(20).reshape(10, 2), np.arange(10)
    >>> idx = mnjax.scatter_index(len(x), comm, shuffle=True, seed=0, epoch=3)
    >>> x_local, y_local = x[idx], y[idx]
    >>> len(idx) == -(-10 // comm.size)
    True
  """
  return _scatter_index(n, comm, shuffle=shuffle, seed=seed, epoch=epoch,
                        force_equal_length=force_equal_length, return_mask=return_mask,
                        caller="scatter_index")


def _scatter_index(n: Any, comm: Communicator, *, shuffle: bool, seed: Any, epoch: Any,
                   force_equal_length: bool, return_mask: bool, caller: str):
  """`scatter_index`, with errors that name the public function the user called."""
  check_communicator(comm, caller)
  check_same_plan(comm, caller, _order_values(n, shuffle, seed, epoch)
                  | {"force_equal_length": force_equal_length})
  indices, mask = shard_indices(_check_size(n, caller), comm.rank, comm.size, shuffle=shuffle,
                                seed=seed, epoch=epoch, force_equal_length=force_equal_length,
                                caller=caller)
  return (indices, mask) if return_mask else indices


def shard_indices(n: int, rank: int, size: int, *, shuffle: bool, seed: Any, epoch: Any,
                  force_equal_length: bool, caller: str,
                  order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Rank `rank`'s ``(indices, mask)`` of `scatter_index`, pure; `order`: a drawn permutation.

  Example:
    >>> shard_indices(5, 2, 3, shuffle=False, seed=0, epoch=0, force_equal_length=True,
    ...               caller="doc")
    (array([3, 4]), array([ True,  True]))
  """
  if order is None:
    order = _permutation(n, shuffle, seed, epoch, caller)
  begin, end, real_end = shard_bounds(n, rank, size, force_equal_length=bool(force_equal_length))
  positions = np.arange(begin, end, dtype=np.int64)
  return order[positions].astype(np.int64), positions < real_end


class SubDataset(Sequence):
  """A read-only view of ``dataset[indices[i]]`` for datasets without fancy indexing.

  Example:
    >>> SubDataset(["a", "b", "c"], np.array([2, 0]))[0]
    'c'
  """

  def __init__(self, dataset: Any, indices: np.ndarray):
    self._dataset = dataset
    self.indices = indices

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return SubDataset(self._dataset, self.indices[i])
    return self._dataset[int(self.indices[i])]


def local_batch_size(global_batch_size: int, comm: Communicator) -> int:
  """The per-process batch size for a global batch, checked to split over the replicas; local.

  Example:
    >>> mnjax.local_batch_size(128, comm) * comm.size    # 32 under mpirun -n 4
    128
  """
  check_communicator(comm, "local_batch_size")
  replicas = comm.num_replicas
  if not _is_int(global_batch_size) or global_batch_size <= 0:
    raise ValueError(
        "local_batch_size: the global batch size must be a positive int, got"
        f" {global_batch_size!r}."
    )
  if global_batch_size % replicas:
    lo = max(replicas, global_batch_size // replicas * replicas)
    raise ValueError(
        f"local_batch_size: the global batch size {global_batch_size} is not divisible by"
        f" the {replicas} replicas ({comm.size} processes x {comm.local_device_count}"
        f" devices). Use a multiple of {replicas}, e.g. {lo} or {lo + replicas}."
    )
  return global_batch_size // comm.size


def _slices(n: Any, global_batch_size: Any, rank: Any, size: Any, *, shuffle: bool,
            seed: int, epoch: int, drop_remainder: bool,
            caller: str) -> tuple[np.ndarray, np.ndarray]:
  """`global_batch_slices`, with errors that name the public function the user called."""
  if not _is_int(size) or size < 1 or not _is_int(rank) or not 0 <= rank < size:
    raise ValueError(
        f"{caller}: rank and size must be ints with 0 <= rank < size, got rank={rank!r},"
        f" size={size!r}.")
  if not _is_int(global_batch_size) or global_batch_size <= 0 or global_batch_size % size:
    raise ValueError(
        f"{caller}: the global batch size must be a positive multiple of the {size}"
        f" processes, got {global_batch_size!r}. Use a multiple of {size}.")
  n = _check_n(n, caller)
  steps = n // global_batch_size if drop_remainder else -(-n // global_batch_size)
  if steps == 0:
    raise ValueError(
        f"{caller}: {n} examples make no full global batch of {global_batch_size};"
        " use a smaller global batch size (or fewer ranks), or drop_remainder=False."
    )
  per_rank = global_batch_size // size
  order = _permutation(n, shuffle, seed, epoch, caller)
  positions = (np.arange(steps)[:, None] * global_batch_size + rank * per_rank
               + np.arange(per_rank)[None, :])
  mask = positions < n
  return np.where(mask, order[np.minimum(positions, n - 1)], 0).astype(np.int64), mask


def global_batch_slices(
    n: int,
    global_batch_size: int,
    *,
    rank: int,
    size: int,
    shuffle: bool,
    seed: int = 0,
    epoch: int = 0,
    drop_remainder: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
  """Process `rank` of `size`'s slice of every global batch of an epoch. Pure.

  Global batch ``s`` is positions ``[s * B, (s + 1) * B)`` of the permutation (``B``:
  `global_batch_size`). ``drop_remainder=False`` pads the last one (index 0, mask False).
  Returns int64 ``indices`` and bool ``mask`` of shape ``(steps, B // size)``.

  Example:
    >>> idx, mask = mnjax.data.global_batch_slices(10, 4, rank=0, size=2, shuffle=False,
    ...                                             drop_remainder=False)
    >>> idx.tolist(), mask.tolist()
    ([[0, 1], [4, 5], [8, 9]], [[True, True], [True, True], [True, True]])
  """
  return _slices(n, global_batch_size, rank, size, shuffle=shuffle, seed=seed, epoch=epoch,
                 drop_remainder=drop_remainder, caller="global_batch_slices")


def epoch_batches(
    n: int,
    comm: Communicator,
    global_batch_size: int,
    *,
    shuffle: bool,
    seed: int = 0,
    epoch: int = 0,
    drop_remainder: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """This process's ``(indices, mask)`` per step: `global_batch_slices` for ``comm``.

  Collective, once per epoch on every rank (the arguments must match).

  Example:
    >>> x, y = np.zeros((100, 8, 8, 1)), np.arange(100)
    >>> for idx, mask in mnjax.epoch_batches(len(x), comm, 32, shuffle=True, epoch=0):
    ...   images, labels = x[idx], y[idx]       # then: state, metrics = step(state, ...)
    >>> images.shape[0] * comm.size
    32
  """
  check_communicator(comm, "epoch_batches")
  check_same_plan(comm, "epoch_batches", _order_values(n, shuffle, seed, epoch)
                  | {"global_batch_size": global_batch_size, "drop_remainder": drop_remainder})
  local_batch_size(global_batch_size, comm)  # divisible by every replica, not only processes
  indices, mask = _slices(n, global_batch_size, comm.rank, comm.size, shuffle=shuffle,
                          seed=seed, epoch=epoch, drop_remainder=drop_remainder,
                          caller="epoch_batches")
  return zip(indices, mask)
