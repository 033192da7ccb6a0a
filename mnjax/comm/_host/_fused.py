"""Fused numpy buffers, one per dtype: one MPI call per dtype, not one per leaf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _recorder as recorder
from mnjax.comm._instep._buckets import group_by_dtype

__all__ = ["fuse", "reduce_arrays", "split"]


def fuse(arrays: Sequence[np.ndarray], dtype: Any = None) -> np.ndarray:
  """A new 1-D buffer of the arrays raveled end to end, cast to `dtype` (default: the first's).

  Example:
    >>> fuse([np.ones((2, 2)), np.zeros(3, np.int32)], np.float64).shape
    (7,)
  """
  dtype = np.asarray(arrays[0]).dtype if dtype is None else np.dtype(dtype)
  return np.concatenate([np.asarray(a, dtype).ravel() for a in arrays])


def split(buf: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Views of `buf` with the shapes of `like` (in `buf`'s dtype): the inverse of `fuse`.

  Example:
    >>> [x.shape for x in split(np.arange(7.0), [np.ones((2, 2)), np.zeros(3)])]
    [(2, 2), (3,)]
  """
  out, offset = [], 0
  for a in like:
    size = int(np.size(a))
    out.append(buf[offset:offset + size].reshape(np.shape(a)))
    offset += size
  return out


def reduce_arrays(arrays: Sequence[np.ndarray], comm: Communicator,
                  op: MPI.Op = MPI.SUM) -> list[np.ndarray]:
  """The reduction (`op`) over ranks of every array in its own dtype, one MPI call per dtype
  (collective). Unchecked: every rank passes the same shapes and dtypes (`check_same_tree`).

  Example:
    >>> ones, counts = reduce_arrays([np.ones(3), np.arange(2)], comm)
    >>> ones.tolist() == [comm.size] * 3, counts.dtype
    (True, dtype('int64'))
  """
  if comm.size == 1:
    return [np.array(a) for a in arrays]
  out: list[Any] = [None] * len(arrays)
  for group in group_by_dtype([a.dtype for a in arrays], key=lambda dtype: dtype):
    members = [arrays[i] for i in group.positions]
    buf = fuse(members, group.dtype)
    with recorder.host_span("host allreduce", bytes=buf.nbytes):
      comm.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=op)
    for i, piece in zip(group.positions, split(buf, members)):
      out[i] = piece
  return out
