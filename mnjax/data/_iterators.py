"""The same batches on every rank: ChainerMN's multi-node and synchronized iterators."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host import _objects as objects
from mnjax.comm._host._broadcast import broadcast
from mnjax.data._agreement import check_same_plan
from mnjax.data._sharding import _is_int, _order_values, _slices

__all__ = ["create_multi_node_iterator", "create_synchronized_iterator"]


def create_multi_node_iterator(batches: Iterable[Any] | None, comm: Communicator, *,
                               rank_master: int = 0) -> Iterator[Any]:
  """Rank `rank_master`'s batches (pytrees of arrays) broadcast to every rank, one per step.

  ChainerMN's. Collective at creation and at each step; `batches` is read on `rank_master`
  only, and its errors raise on every rank.

  Example:
    >>> data = [(np.full((2, 3), i, np.float32), np.arange(2)) for i in range(3)]
    >>> mine = data if comm.rank == 0 else None        # only the master reads the data
    >>> got = list(mnjax.data.create_multi_node_iterator(mine, comm))
    >>> len(got), got[2][0][0].tolist()                # the same batches on every rank
    (3, [2.0, 2.0, 2.0])
  """
  caller = "create_multi_node_iterator"
  check_communicator(comm, caller)
  check_same_plan(comm, caller, {"rank_master": rank_master})
  if not _is_int(rank_master) or not 0 <= rank_master < comm.size:
    raise ValueError(f"{caller}: rank_master must be a rank in [0, {comm.size}), got"
                     f" {rank_master!r}; pass rank_master=0 to read the data on the first rank.")
  master = int(rank_master)
  iterator, problem = None, None
  if comm.rank == master:
    try:
      iterator = iter(batches)
    except TypeError:
      problem = (f"{caller}: the batches of rank {master} (rank_master) must be an iterable"
                 f" of batches, got {type(batches).__name__}.")
  problem = objects.bcast_obj(problem, comm, master, operation=caller)
  if problem is not None:
    raise TypeError(problem)
  return _follow(iterator, comm, master)


def _follow(iterator: Iterator[Any] | None, comm: Communicator, master: int) -> Iterator[Any]:
  """One header round and one `broadcast` per batch, until the master's iterator ends."""
  while True:
    header, batch, error = None, None, None
    if comm.rank == master:
      header, batch, error = _next(iterator, master)
    header = objects.bcast_obj(header, comm, master,
                               operation="create_multi_node_iterator's next batch")
    if header[0] == "stop":
      return
    if header[0] == "error":
      raise (TypeError if header[1] == "type" else RuntimeError)(header[2]) from error
    _, treedef, signature = header
    if comm.rank != master:
      batch = jax.tree_util.tree_unflatten(
          treedef, [np.empty(shape, dtype) for shape, dtype in signature])
    yield broadcast(batch, comm, root=master)


def _next(iterator: Iterator[Any], master: int) -> tuple[tuple, Any, BaseException | None]:
  """The master's ``(header, batch as numpy, error)`` for the next step."""
  caller = "create_multi_node_iterator"
  try:
    batch = next(iterator)
  except StopIteration:
    return ("stop",), None, None
  except Exception as e:  # noqa: BLE001  (sent to every rank, raised there)
    return ("error", "raised", f"{caller}: the batches of rank {master} (rank_master) raised"
            f" {type(e).__name__}: {e}"), None, e
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [np.asarray(leaf) for leaf in leaves]
  bad = [i for i, a in enumerate(arrays) if a.dtype.hasobject]
  if not leaves or bad:
    what = "no arrays" if not leaves else (
        f"a leaf of type {type(leaves[bad[0]]).__name__}, not an array")
    return ("error", "type", f"{caller}: a batch must be a pytree of arrays (numbers or"
            f" fixed-width strings), but rank {master}'s holds {what}. Convert the batch to"
            " numpy arrays before it is broadcast."), None, None
  signature = [(a.shape, a.dtype) for a in arrays]
  return ("batch", treedef, signature), jax.tree_util.tree_unflatten(treedef, arrays), None


def create_synchronized_iterator(
    n: int,
    comm: Communicator,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    epoch: int = 0,
    drop_remainder: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """The same ``(indices, mask)`` batches on every rank, in one shuffled order (ChainerMN's).

  Collective when called; ``seed=None``: rank 0 draws one. ``drop_remainder=False`` pads the
  last batch (index 0, mask False).

  Example:
    >>> batches = mnjax.data.create_synchronized_iterator(10, comm, 4, seed=0, epoch=1)
    >>> [idx.tolist() for idx, _ in batches]        # the same on every rank
    [[9, 1, 3, 8], [7, 6, 0, 4]]
  """
  caller = "create_synchronized_iterator"
  check_communicator(comm, caller)
  check_same_plan(comm, caller, _order_values(n, shuffle, seed, epoch)
                  | {"batch_size": batch_size, "drop_remainder": drop_remainder})
  if not _is_int(batch_size) or batch_size <= 0:
    raise ValueError(f"{caller}: batch_size must be a positive int (examples per batch, the"
                     f" same on every rank), got {batch_size!r}.")
  if shuffle and seed is None:
    seed = int(np.random.SeedSequence().entropy % 2**32) if comm.rank == 0 else None
    seed = objects.bcast_obj(seed, comm, 0, operation=f"{caller}'s seed")
  indices, mask = _slices(n, int(batch_size), 0, 1, shuffle=shuffle, seed=seed, epoch=epoch,
                          drop_remainder=drop_remainder, caller=caller)
  return zip(indices, mask)
