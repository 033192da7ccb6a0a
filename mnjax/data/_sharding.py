"""Data sharding: which examples this rank sees, and in what order (ChainerMN's scatter).

Every rank computes the same global permutation from ``(seed, epoch)`` — no communication
— and takes its own contiguous block of it. With ``force_equal_length=True`` (ChainerMN's
default) every rank gets ``ceil(n / size)`` indices: the short blocks are padded with the
next examples of the permutation, so a few examples are seen twice per epoch but every
rank runs the same number of steps (a rank that runs one step fewer would hang the others
in the allreduce). The padding is reported by ``return_mask=True`` so that evaluation can
weight duplicates 0 and stay exact (see `mnjax.train._metrics`).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import jax
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator

__all__ = [
    "scatter_index",
    "scatter_dataset",
    "local_batch_size",
    "epoch_batches",
    "SubDataset",
]


def _check_n(n: Any, comm: Communicator, caller: str) -> int:
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
    raise TypeError(f"{caller}: the dataset size must be a non-negative int, got {n!r}.")
  if n < comm.size:
    raise ValueError(
        f"{caller}: a dataset of {n} examples cannot be split over {comm.size} ranks:"
        f" every rank needs at least one example. Use a dataset with >= {comm.size}"
        f" examples or run with at most {max(n, 1)} ranks (mpirun -n {max(n, 1)})."
    )
  return int(n)


def _permutation(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
  """The epoch's example order, identical on every rank: a function of (seed, epoch) only."""
  if not shuffle:
    return np.arange(n)
  return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


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
  """This rank's indices into a dataset of `n` examples.

  The union over ranks covers ``range(n)``. The order is a permutation drawn from
  ``(seed, epoch)`` when `shuffle`, identical on every rank, so shards change every epoch
  and are reproducible.

  Args:
    n: number of examples (must be >= ``comm.size``).
    comm: the `Communicator`.
    shuffle: permute before splitting.
    seed: base seed of the permutation (the same on every rank).
    epoch: epoch number; a new permutation per epoch.
    force_equal_length: pad every shard to ``ceil(n / size)`` with the next examples of the
      permutation (duplicates). ``False``: an exact partition of unequal lengths.
    return_mask: also return a bool array, False where an index is a padding duplicate.

  Returns:
    int64 indices, or ``(indices, mask)`` when `return_mask`.

  Example:
    >>> idx = mnjax.scatter_index(len(x), comm, shuffle=True, seed=0, epoch=epoch)
    >>> x_local, y_local = x[idx], y[idx]
  """
  check_communicator(comm, "scatter_index")
  n = _check_n(n, comm, "scatter_index")
  order = _permutation(n, shuffle, seed, epoch)
  begin = n * comm.rank // comm.size
  end = n * (comm.rank + 1) // comm.size
  length = -(-n // comm.size) if force_equal_length else end - begin
  positions = np.arange(begin, begin + length)
  mask = positions < end
  indices = order[positions % n].astype(np.int64)
  return (indices, mask) if return_mask else indices


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


def scatter_dataset(dataset: Any, comm: Communicator, **kwargs) -> Any:
  """This rank's shard of `dataset` (same options as `scatter_index`).

  Args:
    dataset: a numpy array, a pytree of arrays sharing their leading dimension (e.g. a tuple
      ``(images, labels)`` or a dict), or any sequence with ``len`` and ``[]``.
    comm: the `Communicator`.
    **kwargs: `scatter_index` options (shuffle, seed, epoch, force_equal_length).

  Returns:
    The shard, of the same kind: arrays are indexed, other sequences become `SubDataset`.

  Example:
    >>> x_local, y_local = mnjax.scatter_dataset((x, y), comm, shuffle=True, seed=0)
  """
  check_communicator(comm, "scatter_dataset")
  if kwargs.get("return_mask"):
    raise ValueError("scatter_dataset: return_mask is for scatter_index; call it directly.")
  leaves = jax.tree_util.tree_leaves(dataset)
  if leaves and all(hasattr(leaf, "shape") and getattr(leaf, "ndim", 0) >= 1 for leaf in leaves):
    lengths = {int(leaf.shape[0]) for leaf in leaves}
    if len(lengths) != 1:
      raise ValueError(
          "scatter_dataset: all arrays of the dataset must have the same number of"
          f" examples (leading dimension), got {sorted(lengths)}."
      )
    idx = scatter_index(lengths.pop(), comm, **kwargs)
    return jax.tree_util.tree_map(lambda a: a[idx], dataset)
  if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
    return SubDataset(dataset, scatter_index(len(dataset), comm, **kwargs))
  raise TypeError(
      "scatter_dataset: expected an array, a pytree of arrays or a sequence (len and []),"
      f" got {type(dataset).__name__}."
  )


def local_batch_size(global_batch_size: int, comm: Communicator) -> int:
  """The per-process batch size for a global batch, checked to split evenly.

  Example:
    >>> mnjax.local_batch_size(128, comm)   # under mpirun -n 4
    32
  """
  check_communicator(comm, "local_batch_size")
  replicas = comm.num_replicas
  if (
      not isinstance(global_batch_size, (int, np.integer))
      or isinstance(global_batch_size, bool)
      or global_batch_size <= 0
  ):
    raise ValueError(
        "local_batch_size: the global batch size must be a positive int, got"
        f" {global_batch_size!r}."
    )
  if global_batch_size % replicas:
    lo = max(replicas, global_batch_size // replicas * replicas)
    raise ValueError(
        f"local_batch_size: the global batch size {global_batch_size} is not divisible by the {replicas}"
        f" replicas ({comm.size} processes x {comm.local_device_count} devices). Use a"
        f" multiple of {replicas}, e.g. {lo} or {lo + replicas}."
    )
  return global_batch_size // comm.size


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
  """Yields this process's ``(indices, mask)`` per step; the same step count on every rank.

  Each *global* batch is a consecutive chunk of the epoch's permutation (drawn from
  ``(seed, epoch)`` as in `scatter_index`), and process ``r`` takes the ``r``-th slice of
  it (its local devices then split that slice in order). So the examples of every step,
  and the replica that sees each one, do not depend on how the replicas are grouped into
  processes and devices: 4 processes x 1 device and 2 x 2 train identically, and both
  equal one process on the global batch.

  Training (``drop_remainder=True``): full global batches only. Evaluation
  (``drop_remainder=False``): the last global batch is padded (index 0, mask False), so a
  masked sum over all steps of all ranks counts every example exactly once, with one static
  batch shape (no recompilation).

  Example:
    >>> for idx, mask in mnjax.epoch_batches(len(x), comm, 128, shuffle=True, epoch=e):
    ...   state, metrics = step(state, x[idx], y[idx])
  """
  per_rank = local_batch_size(global_batch_size, comm)
  n = _check_n(n, comm, "epoch_batches")
  order = _permutation(n, shuffle, seed, epoch)
  steps = n // global_batch_size if drop_remainder else -(-n // global_batch_size)
  if steps == 0:
    raise ValueError(
        f"epoch_batches: {n} examples make no full global batch of {global_batch_size};"
        " use a smaller global batch size or pass drop_remainder=False."
    )
  for s in range(steps):
    positions = s * global_batch_size + comm.rank * per_rank + np.arange(per_rank)
    mask = positions < n
    yield np.where(mask, order[np.minimum(positions, n - 1)], 0), mask
