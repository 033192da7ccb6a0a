"""Exact global metrics (host-level, collective), from per-rank sums and counts or means."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host import _broadcast as host
from mnjax.comm._host._digest import leaf_digest

__all__ = ["allreduce_metrics", "global_mean", "mean_metrics"]


def allreduce_metrics(metrics: Any, comm: Communicator, *, per_replica: bool = False) -> Any:
  """Sums a pytree of per-rank metric sums/counts over all ranks (host-level, collective).

  Call it on every rank, outside `jax.jit`, with the same tree everywhere (else the same
  `ValueError` on every rank). Integers are summed as int64, floats as float64.

  With ``per_replica=True`` every leaf holds one row per replica of this process (a first
  axis of ``comm.local_device_count``: per-device outputs of `mnjax.data_parallel`), and the
  result adds all ``comm.num_replicas`` rows one by one, replica 0 first: under
  ``create_communicator(..., replicas=V)`` the same bits at any number of processes (a
  process's sum over its examples, and MPI's order, depend on how many there are).

  Args:
    metrics: pytree of scalars or arrays, e.g. ``{"loss_sum": ..., "count": ...}``.
    per_replica: the leaves are rows of this process's replicas (see above).

  Example:
    >>> local = {"correct": 90, "count": 100}    # this rank's shard
    >>> total = mnjax.allreduce_metrics(local, comm)
    >>> accuracy = total["correct"] / total["count"]  # exact over the whole split
    >>> rows = {"count": np.full(comm.local_device_count, 4)}  # 4 examples per replica
    >>> int(mnjax.allreduce_metrics(rows, comm, per_replica=True)["count"]) == 4 * comm.num_replicas
    True
  """
  if not isinstance(per_replica, bool):
    raise TypeError(f"allreduce_metrics: per_replica must be a bool, got {per_replica!r}.")
  if per_replica:
    rows = host.replica_rows(metrics, comm, caller="allreduce_metrics")
    totals = jax.tree.map(lambda r: functools.reduce(np.add, r[1:], r[0].copy()), rows)
  else:
    totals = host.allreduce(metrics, comm, caller="allreduce_metrics")
  return jax.tree.map(lambda total: total if np.ndim(total) else total[()], totals)


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


def mean_metrics(metrics: Any, comm: Communicator, *, weight: Any = 1) -> Any:
  """The global mean of per-rank mean metrics: ``jax.lax.pmean`` over ranks, on the host.

  For a step ported from flax's ``jax.lax.pmean(metrics, axis_name="batch")``: drop the
  ``pmean`` and call this on the step's output, on every rank, outside `jax.jit`. Each leaf
  becomes ``sum_r weight_r * value_r / sum_r weight_r`` in float64 (a rank with weight 0 is
  left out, NaNs too); a leaf bitwise equal on every rank comes back as it is. Per-device
  outputs of `mnjax.data_parallel` need their device axis reduced first.

  Args:
    metrics: pytree of numbers, the same structure and shapes on every rank.
    weight: this rank's number of examples behind its means (finite, >= 0); the default 1
      averages ranks equally, as ``pmean`` does.

  Raises:
    ValueError: on every rank, if the trees differ, some rank's `weight` is not a finite
      number >= 0, or the weights sum to 0.

  Example:
    >>> # what a step ported from flax returns, without its pmean: this rank's means
    >>> metrics = {"loss": jnp.float32(0.5), "accuracy": jnp.float32(0.75), "lr": 0.125}
    >>> mnjax.mean_metrics(metrics, comm, weight=32)   # 32 examples behind them on this rank
    {'accuracy': 0.75, 'loss': 0.5, 'lr': 0.125}
  """
  check_communicator(comm, "mean_metrics")
  leaves, treedef = jax.tree_util.tree_flatten(metrics)
  values = [np.asarray(leaf) for leaf in leaves]
  w, valid = _weight(weight)
  weighted = [_weighted(value, w) for value in values]
  host.check_same_tree(jax.tree_util.tree_unflatten(treedef, weighted), comm, "mean_metrics")
  host.check_numbers(jax.tree_util.tree_unflatten(treedef, values), "mean_metrics")
  *sums, (total, invalid) = host.reduce_arrays([*weighted, np.array([w, float(not valid)])],
                                               comm)
  if invalid:
    raise ValueError(
        f"mean_metrics: weight must be a finite number >= 0 on every rank (the number of"
        f" examples behind the rank's means; default 1), but {int(invalid)} of {comm.size}"
        f" rank(s) passed another (this rank: {repr(weight)[:80]}). Pass e.g."
        " weight=len(labels), or weight=mask.sum() with padded batches.")
  if total <= 0:
    raise ValueError(
        "mean_metrics: the weights sum to 0 over all ranks, so no example stands behind"
        " the means. Pass each rank's number of examples as weight (0 only on a rank that"
        " has none).")
  same = _same_on_every_rank(values, comm)
  out = [_host_value(value if equal else summed / total)
         for value, summed, equal in zip(values, sums, same)]
  return jax.tree_util.tree_unflatten(treedef, out)


def _weight(weight: Any) -> tuple[float, bool]:
  """(`weight` as a float, whether it is valid: one finite real number >= 0, not a bool)."""
  try:
    w = np.asarray(weight)
  except (TypeError, ValueError):
    return 0.0, False
  real = jnp.issubdtype(w.dtype, jnp.integer) or jnp.issubdtype(w.dtype, jnp.floating)
  if w.shape != () or not real or not np.isfinite(w) or w < 0:
    return 0.0, False
  return float(w), True


def _weighted(value: np.ndarray, w: float) -> np.ndarray:
  """``w * value`` in float64 (or complex128); zeros, not NaNs, where ``w`` is 0."""
  if not host.is_number(value.dtype):
    return value
  x = np.asarray(value, np.result_type(value.dtype, np.float64))
  return x * w if w > 0 else np.zeros_like(x)


def _same_on_every_rank(values: list[np.ndarray], comm: Communicator) -> list[bool]:
  """Per leaf, bitwise equal on every rank: ``max(d) == ~max(~d)`` of its 64-bit digest ``d``."""
  if comm.size == 1 or not values:
    return [True] * len(values)
  words = np.array([int(leaf_digest(v, digest_size=8), 16) for v in values], np.uint64)
  (high,) = host.reduce_arrays([np.concatenate([words, ~words])], comm, op=MPI.MAX)
  return [bool(x) for x in high[:len(values)] == ~high[len(values):]]


def _host_value(x: np.ndarray) -> Any:
  """Scalars as Python numbers (JSON-ready), arrays as numpy."""
  return x.item() if np.ndim(x) == 0 else np.asarray(x)
