"""Exact global metrics: sum per-rank *sums and counts*, never average per-rank averages.

Averaging per-rank accuracies is wrong as soon as ranks hold different numbers of real
examples (the last shard is shorter, padded duplicates from ``force_equal_length``, the
last partial batch). The rule here: each rank reports additive quantities (sum of losses,
number correct, number of real examples — padding weighted 0), `allreduce_metrics` adds
them exactly (integers as int64, floats as float64), and only then are ratios formed
(`global_mean`).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from mpi4py import MPI

from mnjax.comm._communicator import Communicator, check_communicator

__all__ = ["allreduce_metrics", "global_mean"]


def allreduce_metrics(metrics: Any, comm: Communicator) -> Any:
  """Sums a pytree of per-rank metric sums/counts over all ranks (host-level, collective).

  Integers are summed exactly as int64, floats in float64. Call it on every rank, outside
  `jax.jit`, with the same tree structure everywhere.

  Args:
    metrics: pytree of scalars or arrays, e.g. ``{"loss_sum": ..., "correct": ...,
      "count": ...}``; jax arrays are fetched to the host.
    comm: the `Communicator`.

  Returns:
    The same structure holding numpy int64/float64 global sums.

  Example:
    >>> local = {"correct": 90, "count": 100}    # this rank's shard
    >>> total = mnjax.allreduce_metrics(local, comm)
    >>> accuracy = total["correct"] / total["count"]  # exact over the whole split
  """
  check_communicator(comm, "allreduce_metrics")
  leaves, treedef = jax.tree_util.tree_flatten(metrics)
  arrays = [np.asarray(leaf) for leaf in leaves]
  for path, a in zip(jax.tree_util.tree_flatten_with_path(metrics)[0], arrays):
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
      raise TypeError(
          f"allreduce_metrics: leaf {jax.tree_util.keystr(path[0])} has dtype {a.dtype};"
          " expected numbers (sums and counts). Convert strings or objects before reducing."
      )
  exact = [np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ for a in arrays]
  out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
  for is_int, dtype in ((True, np.int64), (False, np.float64)):
    idx = [i for i, e in enumerate(exact) if e == is_int]
    if not idx:
      continue
    buf = np.concatenate([arrays[i].astype(dtype).ravel() for i in idx])
    if comm.size > 1:
      comm.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    offset = 0
    for i in idx:
      out[i] = buf[offset:offset + arrays[i].size].reshape(arrays[i].shape)
      offset += arrays[i].size
  return jax.tree_util.tree_unflatten(treedef, [o if o.ndim else o[()] for o in out])


def global_mean(totals: Mapping[str, Any], count_key: str = "count") -> dict[str, Any]:
  """Turns global sums into means: every ``<name>_sum`` or ``<name>`` divided by the count.

  Example:
    >>> global_mean({"loss_sum": 12.0, "correct": 90, "count": 100})
    {'loss': 0.12, 'correct': 0.9, 'count': 100}
  """
  count = totals[count_key]
  if count <= 0:
    raise ValueError(f"global_mean: {count_key!r} must be positive, got {count}.")
  means: dict[str, Any] = {}
  for key, value in totals.items():
    if key == count_key:
      means[key] = int(count)
    else:
      mean = np.asarray(value, np.float64) / float(count)
      means[key.removesuffix("_sum")] = float(mean) if mean.ndim == 0 else mean
  return means
