"""`scatter_dataset`: this rank's shard of a dataset that every rank holds, or the root alone."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from mpi4py.util import pkl5

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host import _objects as objects
from mnjax.data._agreement import check_same_plan
from mnjax.data._sharding import (
    SubDataset,
    _check_size,
    _is_int,
    _order_values,
    _permutation,
    shard_indices,
)

__all__ = ["dataset_length", "scatter_dataset", "take"]

#: The tag of the root's sends, apart from any other point-to-point traffic on ``mpi_comm``.
TAG = 0x5CA7


def dataset_length(dataset: Any, caller: str) -> tuple[int, bool]:
  """``(number of examples, whether it is arrays)``; `TypeError`/`ValueError` if not a dataset.

  Example:
    >>> dataset_length((np.zeros((5, 2)), np.arange(5)), "doc"), dataset_length("abc", "doc")
    ((5, True), (3, False))
  """
  leaves = jax.tree_util.tree_leaves(dataset)
  arrays = bool(leaves) and all(hasattr(leaf, "shape") and getattr(leaf, "ndim", 0) >= 1
                                for leaf in leaves)
  if arrays:
    lengths = {int(leaf.shape[0]) for leaf in leaves}
    if len(lengths) != 1:
      raise ValueError(
          f"{caller}: all arrays of the dataset must have the same number of examples"
          f" (leading dimension), got {sorted(lengths)}.")
    return lengths.pop(), True
  if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
    return len(dataset), False
  raise TypeError(
      f"{caller}: expected an array, a pytree of arrays or a sequence (len and []), got"
      f" {type(dataset).__name__}.")


def take(dataset: Any, indices: np.ndarray, arrays: bool) -> Any:
  """``dataset[indices]``: arrays indexed leaf by leaf, other sequences as a `SubDataset`.

  Example:
    >>> take(["a", "b", "c"], np.array([2, 0]), arrays=False)[0]
    'c'
  """
  if arrays:
    return jax.tree_util.tree_map(lambda a: a[indices], dataset)
  return SubDataset(dataset, indices)


def scatter_dataset(dataset: Any, comm: Communicator, *, root: int | None = None,
                    shuffle: bool = False, seed: int = 0, epoch: int = 0,
                    force_equal_length: bool = True, return_mask: bool = False) -> Any:
  """This rank's shard of `dataset`: ``dataset[scatter_index(len(dataset), comm, ...)]``.

  ChainerMN's. Collective. `dataset`: an array, a pytree of arrays sharing their leading
  dimension, or a sequence. With ``root=r`` only rank ``r`` holds it (the others pass None)
  and sends each rank its shard. Other arguments as in `scatter_index`. Returns the shard (a
  sequence as a `SubDataset`, or a list from `root`), or ``(shard, mask)``.

  Example:
    >>> x, y = np.arange(20).reshape(10, 2), np.arange(10)
    >>> x_local, y_local = mnjax.scatter_dataset((x, y), comm, shuffle=True, seed=0)
    >>> bool((x_local[:, 0] // 2 == y_local).all())      # rows stay paired
    True
    >>> shard, mask = mnjax.scatter_dataset(["only"], comm, return_mask=True)
    >>> list(shard), bool(mask.sum()) == (comm.rank == comm.size - 1)  # counted once
    (['only'], True)
    >>> held = (x, y) if comm.rank == 0 else None          # only rank 0 loaded the data
    >>> xr, yr = mnjax.scatter_dataset(held, comm, root=0, shuffle=True, seed=0)
    >>> bool((yr == y_local).all())                        # the same shard as above
    True
  """
  check_communicator(comm, "scatter_dataset")
  if root is not None:
    return _from_root(dataset, comm, root, shuffle=shuffle, seed=seed, epoch=epoch,
                      force_equal_length=force_equal_length, return_mask=return_mask)
  try:
    n, arrays = dataset_length(dataset, "scatter_dataset")
    problem = None
  except (TypeError, ValueError) as e:  # compared below, so every rank raises
    n, arrays, problem = f"not a dataset ({type(dataset).__name__})", False, e
  check_same_plan(comm, "scatter_dataset", _order_values(n, shuffle, seed, epoch)
                  | {"force_equal_length": force_equal_length},
                  fix="If only one rank holds the data, pass root=<that rank> (the others"
                  " pass None).")
  if problem is not None:
    raise problem
  idx, mask = shard_indices(_check_size(n, "scatter_dataset"), comm.rank, comm.size,
                            shuffle=shuffle, seed=seed, epoch=epoch,
                            force_equal_length=force_equal_length, caller="scatter_dataset")
  shard = take(dataset, idx, arrays)
  return (shard, mask) if return_mask else shard


def _from_root(dataset: Any, comm: Communicator, root: Any, *, shuffle: bool, seed: Any,
               epoch: Any, force_equal_length: bool, return_mask: bool) -> Any:
  """`scatter_dataset` from the one rank that holds the data."""
  caller = "scatter_dataset"
  check_same_plan(comm, caller, {"root": root, "shuffle": shuffle}
                  | ({"seed": seed, "epoch": epoch} if shuffle else {})
                  | {"force_equal_length": force_equal_length})
  if not _is_int(root) or not 0 <= root < comm.size:  # the same root everywhere: all raise
    raise ValueError(f"{caller}: root must be None (every rank holds the dataset) or a rank"
                     f" in [0, {comm.size}), got {root!r}.")
  root = int(root)
  header: Any = None
  if comm.rank == root:
    try:
      header = ("ok", *dataset_length(dataset, caller))
    except (TypeError, ValueError) as e:
      header = ("error", type(e).__name__, str(e))
  header = objects.bcast_obj(header, comm, root, operation=caller)
  if header[0] == "error":
    kind = TypeError if header[1] == "TypeError" else ValueError
    raise kind(f"{header[2]} (the dataset of rank {root}, the root, which alone holds the"
               " data: pass it there; root=None when every rank holds it)")
  _, n, arrays = header
  order = _permutation(n, shuffle, seed, epoch, caller)  # once, for every rank's block
  plan = [shard_indices(n, r, comm.size, shuffle=shuffle, seed=seed, epoch=epoch,
                        force_equal_length=force_equal_length, caller=caller, order=order)
          for r in (range(comm.size) if comm.rank == root else [comm.rank])]
  wire = pkl5.Intracomm(comm.mpi_comm)
  if comm.rank == root:
    for r, (idx, _) in enumerate(plan):
      if r != root:
        wire.send(_examples(dataset, idx, arrays, copy=True), dest=r, tag=TAG)
    idx, mask = plan[root]
    shard = _examples(dataset, idx, arrays, copy=False)
  else:
    (_, mask), = plan
    shard = wire.recv(source=root, tag=TAG)
  return (shard, mask) if return_mask else shard


def _examples(dataset: Any, idx: np.ndarray, arrays: bool, *, copy: bool) -> Any:
  """The examples at `idx`: arrays indexed (as numpy to send them), else a list."""
  if not arrays:
    return [dataset[int(i)] for i in idx]
  shard = take(dataset, idx, arrays=True)
  return jax.tree_util.tree_map(np.asarray, shard) if copy else shard
