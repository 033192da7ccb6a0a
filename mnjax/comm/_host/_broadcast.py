"""Host-level collectives on pytrees, outside any trace: `broadcast`, exact sums (`allreduce`),
averages (`allreduce_persistent`); each checks the tree on every rank first."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host._agreement import check_same_tree, gather_if_different
from mnjax.comm._host._fused import fuse, reduce_arrays, split
from mnjax.comm._host._signature import leaf_paths, shares_in
from mnjax.comm._instep import _recorder as recorder
from mnjax.comm._instep._buckets import group_by_dtype

__all__ = ["allreduce", "allreduce_persistent", "broadcast", "check_numbers", "host_sum_dtype",
           "is_number", "replica_rows"]


def is_number(dtype: Any) -> bool:
  """Whether host collectives can sum values of `dtype` (booleans count, as 0 and 1)."""
  dtype = np.dtype(dtype)
  return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def check_numbers(tree: Any, caller: str, *, floats_only: bool = False) -> None:
  """Raises `TypeError` naming the first leaf that is not a number (`floats_only`: real float).

  Example:
    >>> check_numbers({"name": np.asarray("resnet")}, "allreduce_metrics")
    Traceback (most recent call last):
    TypeError: allreduce_metrics: leaf ['name'] has dtype <U6; expected numbers ...
  """
  for path, leaf in zip(leaf_paths(tree), jax.tree_util.tree_leaves(tree)):
    dtype = np.asarray(leaf).dtype
    ok = jnp.issubdtype(dtype, jnp.floating) if floats_only else is_number(dtype)
    if not ok:
      expected = "real floating-point values" if floats_only else "numbers (sums and counts)"
      raise TypeError(
          f"{caller}: leaf {path} has dtype {dtype}; expected {expected}. Convert or drop"
          " such leaves before reducing.")


def host_sum_dtype(dtype: np.dtype) -> np.dtype:
  """The dtype `allreduce` sums `dtype` in exactly: int64, float64 or complex128 (else itself).

  Example:
    >>> host_sum_dtype(np.dtype(np.int32)), host_sum_dtype(np.dtype(np.float32))
    (dtype('int64'), dtype('float64'))
  """
  if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer):
    return np.dtype(np.int64)
  if jnp.issubdtype(dtype, jnp.number):
    return np.result_type(dtype, np.float64)
  return dtype


def allreduce(tree: Any, comm: Communicator, *, caller: str = "allreduce",
              floats_only: bool = False) -> Any:
  """The exact sum over ranks of every leaf, in `host_sum_dtype`, as numpy (collective); `caller`
  names the public function in messages; `floats_only` refuses leaves that are not real floats.

  Example:
    >>> totals = allreduce({"n": True, "x": np.ones(2, np.float32)}, comm)
    >>> int(totals["n"]) == comm.size, totals["n"].dtype, totals["x"].dtype
    (True, dtype('int64'), dtype('float64'))
  """
  check_communicator(comm, caller)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [np.asarray(leaf) for leaf in leaves]
  arrays = [a.astype(host_sum_dtype(a.dtype), copy=False) for a in arrays]
  as_summed = jax.tree_util.tree_unflatten(treedef, arrays)
  check_same_tree(as_summed, comm, caller)
  check_numbers(jax.tree_util.tree_unflatten(treedef, leaves), caller, floats_only=floats_only)
  return jax.tree_util.tree_unflatten(treedef, reduce_arrays(arrays, comm))


def replica_rows(tree: Any, comm: Communicator, *, caller: str = "replica_rows") -> Any:
  """Every replica's row of every leaf, on every rank, in replica order (collective).

  Each leaf's first axis holds this process's replicas: ``comm.local_device_count`` rows, for
  replicas ``rank * L`` to ``rank * L + L - 1`` (``mnjax.data_parallel``'s per-device
  outputs). The result has all ``comm.num_replicas`` rows in `host_sum_dtype`, with the same
  bits whatever the number of processes: each row is placed at its replica's index and only
  added to zeros (``-0.0`` is read as ``0.0``). `caller` names the public function in messages.

  Example:
    >>> rows = replica_rows({"n": np.ones(comm.local_device_count, np.int32)}, comm)
    >>> rows["n"].shape == (comm.num_replicas,), rows["n"].dtype
    (True, dtype('int64'))
  """
  check_communicator(comm, caller)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  arrays = [np.asarray(leaf) for _, leaf in leaves]
  arrays = [a.astype(host_sum_dtype(a.dtype), copy=False) for a in arrays]
  check_same_tree(jax.tree_util.tree_unflatten(treedef, arrays), comm, caller)
  check_numbers(jax.tree_util.tree_unflatten(treedef, arrays), caller)
  rows = comm.local_device_count  # the same on every rank, as the trees now are
  placed = []
  for (path, _), a in zip(leaves, arrays):
    if a.ndim == 0 or a.shape[0] != rows:
      raise ValueError(
          f"{caller}: leaf {jax.tree_util.keystr(path) or '<root>'} has shape {a.shape}, but"
          f" per-replica values need a first axis of this process's {rows} replica(s)"
          f" (comm.local_device_count), one row each. Return them from the step as"
          f" per-device outputs (mnjax.data_parallel(..., per_device_outputs=...)).")
    full = np.zeros((comm.num_replicas, *a.shape[1:]), a.dtype)
    full[comm.rank * rows:(comm.rank + 1) * rows] = a
    placed.append(full + a.dtype.type(0) if np.issubdtype(a.dtype, np.inexact) else full)
  return jax.tree_util.tree_unflatten(treedef, reduce_arrays(placed, comm))


def broadcast(tree: Any, comm: Communicator, root: int = 0) -> Any:
  """Returns `root`'s copy of `tree` on every rank (jax arrays as jax arrays, the rest numpy).

  Call outside `jax.jit`, on every rank, with the same `root` and a tree of the same
  containers, structure, shapes and dtypes; otherwise every rank raises a `ValueError` naming
  the ranks, and nothing moves. `mnjax.shard_optimizer`'s state is refused.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> params = {"w": jnp.full(3, float(comm.rank))}   # e.g. model.init(key of each rank)
    >>> params = mnjax.broadcast(params, comm, root=0)  # rank 0's values, on every rank
    >>> params["w"].tolist()
    [0.0, 0.0, 0.0]
  """
  check_communicator(comm, "broadcast")
  shares = shares_in(tree)
  if shares:  # local, and so on every rank: every rank holds its own share
    raise ValueError(
        f"broadcast: the tree holds mnjax.shard_optimizer's state at {shares[0]}"
        f"{f' (and {len(shares) - 1} more)' if len(shares) > 1 else ''}: each rank holds"
        " its own share of the optimizer state, different on every rank by design, so no"
        " rank's copy is everyone's. Broadcast the parameters only"
        " (params = mnjax.broadcast(params, comm)), then build the optimizer state from them"
        " on every rank (opt_state = tx.init(params): each rank gets its share); to move a"
        " whole optimizer state, use mnjax.optim.gather_optimizer_state and"
        " scatter_optimizer_state. Nothing was exchanged.")
  valid_root = isinstance(root, (int, np.integer)) and not isinstance(root, bool) and (
      0 <= root < comm.size)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [np.asarray(leaf) for leaf in leaves] if comm.size > 1 else leaves
  # One round checks root and tree: another root would hang or take another rank's bytes.
  check_same_tree(jax.tree_util.tree_unflatten(treedef, arrays), comm, "broadcast",
                  root=int(root) if valid_root else 0,
                  arguments={"root": int(root) if valid_root else root})
  if not valid_root:  # the same root on every rank, so the same error on every rank
    raise ValueError(
        f"broadcast: root must be a rank in [0, {comm.size}), got {root!r}; pass root=0"
        " to broadcast from the first rank."
    )
  if comm.size == 1:
    return tree
  out: list[Any] = list(arrays)
  for group in group_by_dtype([a.dtype for a in arrays], key=lambda dtype: dtype):
    members = [arrays[i] for i in group.positions]
    buf = (fuse(members) if comm.rank == root
           else np.empty(sum(a.size for a in members), group.dtype))
    with recorder.host_span("broadcast", bytes=buf.nbytes):  # raw bytes: bfloat16, bool, ...
      comm.mpi_comm.Bcast(buf.view(np.uint8), root=root)
    for i, piece in zip(group.positions, split(buf, members)):
      out[i] = piece
  out = [jnp.asarray(o) if isinstance(leaf, jax.Array) else o for o, leaf in zip(out, leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def allreduce_persistent(tree: Any, comm: Communicator) -> Any:
  """The mean over ranks of every float leaf of `tree` (ChainerMN's ``AllreducePersistent``),
  e.g. BatchNorm statistics; sums in float64, each leaf keeps its dtype. Integer and bool
  leaves pass through; differing ones raise a `ValueError` on every rank. Collective.

  Example:
    >>> stats = {"mean": jnp.full(2, float(comm.rank)), "count": np.int32(7)}  # per rank
    >>> stats = mnjax.nn.allreduce_persistent(stats, comm)  # before evaluating or saving
    >>> stats["mean"].tolist() == [(comm.size - 1) / 2] * 2, int(stats["count"])
    (True, 7)
  """
  caller = "allreduce_persistent"
  check_communicator(comm, caller)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [np.asarray(leaf) for leaf in leaves]
  check_same_tree(jax.tree_util.tree_unflatten(treedef, arrays), comm, caller)
  kept = [a.dtype == np.bool_ or bool(jnp.issubdtype(a.dtype, jnp.integer)) for a in arrays]
  check_numbers(jax.tree_util.tree_unflatten(  # the same tree everywhere: every rank raises
      treedef, [np.float32(0) if k else a for a, k in zip(arrays, kept)]), caller,
      floats_only=True)
  if comm.size == 1:
    return tree
  if any(kept):
    _check_equal_leaves([(p, a) for p, a, k in zip(leaf_paths(tree), arrays, kept) if k],
                        comm, caller)
  averaged = [i for i, k in enumerate(kept) if not k]
  totals = reduce_arrays([arrays[i].astype(host_sum_dtype(arrays[i].dtype)) for i in averaged],
                         comm)
  out = list(leaves)
  for i, total in zip(averaged, totals):
    mean = (total / comm.size).astype(arrays[i].dtype)
    out[i] = jnp.asarray(mean) if isinstance(leaves[i], jax.Array) else mean
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_equal_leaves(named: list[tuple[str, np.ndarray]], comm: Communicator,
                        caller: str) -> None:
  """The same `ValueError` on every rank unless all hold equal ``(path, array)`` leaves."""
  digests = tuple(hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=8).hexdigest()
                  for _, a in named)
  shown = tuple(a.tolist() if a.size <= 4 else f"{a.dtype}{list(a.shape)} hashing to {d}"
                for (_, a), d in zip(named, digests))
  everyone = gather_if_different(comm, f"{caller}'s integer leaves", (digests, shown),
                                 what=f"{caller}'s check of its integer leaves")
  if everyone is None:
    return
  i = next(i for i in range(len(named)) if len({d[i] for d, _ in everyone}) > 1)
  others = [rank for rank, (d, _) in enumerate(everyone) if d[i] != everyone[0][0][i]]
  values = ", ".join(f"rank {rank} {everyone[rank][1][i]}" for rank in [0, *others[:3]])
  more = f" and {len(others) - 3} more ranks" if len(others) > 3 else ""
  raise ValueError(
      f"{caller}: integer/bool leaf {named[i][0]} differs between ranks ({values}{more})."
      " Such"
      " leaves (counters, e.g. num_batches_tracked) are passed through, not averaged, so"
      " every rank must hold the same value: make them equal (count the same steps on every"
      " rank, or mnjax.broadcast them from rank 0) or drop them from the tree before the"
      " call. Nothing was averaged.")
