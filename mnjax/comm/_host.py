"""Host-level collectives on pytrees, outside any trace: broadcast, exact sums, averages.

The one home of what every host collective needs:

* the *tree signature* ranks compare before anything moves (`tree_signature`; the
  pre-flight check of `mnjax.allreduce_gradients` compares it too), and the comparison
  (`gather_if_different`, `check_same_tree`): one allgather of a 16-byte hash, the full
  signatures only on a mismatch, so a wrong tree raises the same `ValueError` on every rank
  instead of corrupting memory or hanging;
* fused numpy buffers, one per dtype (`fuse`, `split`, `reduce_arrays`): one MPI call per
  dtype, not one per leaf.

Built on them: `broadcast` (initial parameters, optimizer state, a restored checkpoint),
`allreduce` (exact sums: integers as int64, floats as float64; under `mnjax.allreduce_metrics`
and `mnjax.mean_metrics`) and `allreduce_persistent` (averaged running statistics). Per-leaf
digests (replica consensus, checkpoint verification) are in `mnjax.comm._digest`.

Traffic is mpi4py on numpy buffers (mpi4py types them itself: raw bytes for `broadcast`),
on ``comm.mpi_comm``, never on the in-step communicators (see `mnjax.comm._primitives`): a
host collective issued while a step still runs asynchronously is never matched with it.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from mnjax.comm import _departures as departures
from mnjax.comm import _recorder as recorder
from mnjax.comm._buckets import group_by_dtype
from mnjax.comm._communicator import Communicator, check_communicator

__all__ = [
    "allreduce", "allreduce_persistent", "broadcast", "check_numbers", "check_same_tree",
    "fuse", "gather_if_different", "is_number", "leaf_paths", "reduce_arrays", "shares_in",
    "split", "tree_containers", "tree_signature", "wait",
]

_HASH_BYTES = 16

#: The key `mnjax.optim.ShardedState` gives its one child (``.shard_<index>_of_<parts>``) so
#: that tools for replicated trees can tell a rank's own share of the optimizer state.
_SHARE_KEY = re.compile(r"\.shard_\d+_of_\d+")


def leaf_paths(tree: Any) -> list[str]:
  """Every leaf's path, in flattening order (``<root>`` for a tree that is one leaf).

  Example:
    >>> leaf_paths({"w": 1, "b": [2, 3]})
    ["['b'][0]", "['b'][1]", "['w']"]
  """
  return [jax.tree_util.keystr(path) or "<root>"
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def shares_in(tree: Any) -> list[str]:
  """The paths of the `mnjax.shard_optimizer` states (`mnjax.optim.ShardedState`) in `tree`,
  each ending in its share's key: this rank's own share of the optimizer state, different
  on every rank by design.

  Example:
    >>> state = {"opt": mnjax.shard_optimizer(comm, optax.adam(0.1)).init({"w": jnp.ones(3)})}
    >>> shares_in(state), shares_in({"w": jnp.ones(3)})
    (["['opt'].shard_0_of_1"], [])
  """
  found: list[str] = []
  for path in leaf_paths(tree):
    match = _SHARE_KEY.search(path)
    if match and path[:match.end()] not in found:
      found.append(path[:match.end()])
  return found


def tree_signature(tree: Any) -> tuple[tuple[str, tuple[int, ...], str], ...]:
  """``(leaf path, shape, dtype)`` for every leaf of `tree`, in flattening order.

  What ranks must agree on before they exchange a tree. Works on concrete arrays and on
  tracers (shape and dtype are static).

  Example:
    >>> tree_signature({"w": jnp.zeros((2, 3))})
    (("['w']", (2, 3), 'float32'),)
  """
  return tuple(
      (path, tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__)))
      for path, leaf in zip(leaf_paths(tree), jax.tree_util.tree_leaves(tree))
  )


def gather_if_different(comm: Communicator, value: Any, *, timeout: float | None = None,
                        timeout_message: str = "", what: str = "a host collective"
                        ) -> list[Any] | None:
  """None when every rank passed an equal `value`; otherwise every rank's value.

  Collective over ``comm.mpi_comm``: one allgather of a 16-byte BLAKE2b hash of
  ``repr(value)`` (so `value` needs a deterministic ``repr``); the values themselves travel
  only on a mismatch, and every rank then gets the same list. With `timeout`, a rank that
  waits longer for the others raises `TimeoutError` with `timeout_message`. A rank that
  finished its program while the others wait here (`mnjax.comm._departures`) is a
  `RuntimeError` on each of them, naming it and `what` they wait in.

  Example:
    >>> gather_if_different(comm, tree_signature({"w": np.zeros(3)})) is None  # same everywhere
    True
  """
  if comm.size == 1:
    return None
  mine = np.frombuffer(
      hashlib.blake2b(repr(value).encode(), digest_size=_HASH_BYTES).digest(), np.uint8)
  everyone = np.empty((comm.size, _HASH_BYTES), np.uint8)
  with recorder.host_span("pre-flight check", bytes=_HASH_BYTES):
    _wait(comm, comm.mpi_comm.Iallgather(mine, everyone), timeout, timeout_message, what)
  if (everyone == everyone[0]).all():
    return None
  return comm.mpi_comm.allgather(value)


#: Seconds a rank keeps waiting after learning that a peer finished: the peer may have done
#: its part of this very collective just before it left.
DEPARTURE_GRACE = 2.0


def wait(comm: Communicator, request: Any, what: str, *, peers: Sequence[int] | None = None,
         timeout: float | None = None, timeout_message: str = "") -> None:
  """Completes `request` (anything with MPI's ``Test()``) on ``comm.mpi_comm``; raises
  `RuntimeError` naming a rank of `peers` (default: any rank) that finished its program
  while this rank waits in `what`, and with `timeout`, `TimeoutError` (`timeout_message`).

  Example:
    >>> wait(comm, comm.mpi_comm.Ibarrier(), "a barrier")
  """
  _wait(comm, request, timeout, timeout_message, what, peers)


def _wait(comm: Communicator, request: Any, timeout: float | None, timeout_message: str,
          what: str, peers: Sequence[int] | None = None) -> None:
  """Completes `request`, or raises on a timeout or on a peer that finished meanwhile."""

  def departed() -> list[int]:
    return [r for r in departures.departed(comm.mpi_comm) if peers is None or r in peers]

  start = time.monotonic()
  gone_since = None
  while not request.Test():
    now = time.monotonic()
    if timeout is not None and now - start > timeout:
      raise TimeoutError(timeout_message)
    if gone_since is None and now - start > 0.05 and departed():
      gone_since = now
    if gone_since is not None and now - gone_since > DEPARTURE_GRACE:
      gone = departed()
      raise RuntimeError(
          f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} finished"
          f" {'their programs' if len(gone) > 1 else 'its program'} (exited normally) while"
          f" the other ranks wait for every rank in {what}: the job cannot go on. The ranks"
          " must run the same program (the same steps, the same calls of mnjax's"
          " collectives and checks); look for a loop, a condition or a model that differs"
          " between ranks.")
    time.sleep(1e-3 if now - start < 1.0 else 1e-2)


def tree_containers(tree: Any) -> tuple[tuple[str, str], ...]:
  """``(path, container type)`` for every inner node of `tree`, outermost first.

  What `tree_signature` cannot see: a list and a tuple (or a dict and a flax ``FrozenDict``)
  give the same leaf paths. Types are named by module (but builtins) and qualified name only,
  so the result is the same on every rank for the same tree.

  Example:
    >>> tree_containers({"b": [1, 2], "w": (3,)})
    (('<root>', 'dict'), ("['b']", 'list'), ("['w']", 'tuple'))
  """
  out: list[tuple[str, str]] = []

  def walk(node: Any, path: str) -> None:
    data = jax.tree_util.tree_structure(node).node_data()
    if data is None:  # a leaf
      return
    kind = data[0]
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")
    out.append((path or "<root>", name))
    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    for keys, child in children:
      walk(child, path + jax.tree_util.keystr(keys))

  walk(tree, "")
  return tuple(out)


def check_same_tree(tree: Any, comm: Communicator, caller: str, *, root: int = 0,
                    arguments: dict[str, Any] | None = None) -> None:
  """Raises `ValueError` on every rank unless every rank passed a tree with the same
  containers (`tree_containers`), structure, shapes and dtypes (`tree_signature`) as rank
  `root`, and equal `arguments` (e.g. ``{"root": 0}``, compared by ``repr``): all in one
  agreement round. Collective.

  Example:
    >>> check_same_tree({"mean": np.zeros(3)}, comm, "my_average")  # before moving it
  """
  arguments = {name: repr(value) for name, value in (arguments or {}).items()}
  everyone = gather_if_different(comm, (arguments, tree_containers(tree), tree_signature(tree)),
                                 what=f"{caller}'s check that every rank passed the same tree")
  if everyone is None:
    return
  for name in arguments:
    passed = [args[name] for args, _, _ in everyone]
    if len(set(passed)) > 1:
      listed = ", ".join(f"rank {rank} {name}={value}" for rank, value in enumerate(passed))
      raise ValueError(
          f"{caller}: every rank must pass the same {name}, but {listed}. Pass one value on"
          f" every rank (e.g. a constant, not one computed from comm.rank); nothing was"
          " exchanged.")
  _, ref_containers, ref = everyone[root]
  differing = [rank for rank, got in enumerate(everyone) if got[1:] != (ref_containers, ref)]
  details = []
  for rank in differing:
    before = len(details)
    _, containers, sig = everyone[rank]
    kinds = next(((c, r) for c, r in zip(containers, ref_containers) if c != r), None)
    if kinds is not None:
      (path, kind), (rpath, rkind) = kinds
      details.append(f"rank {rank} has a {kind} at {path} where rank {root} has a {rkind}"
                     + (f" at {rpath}" if rpath != path else ""))
    if len(sig) != len(ref):
      details.append(f"rank {rank} has {len(sig)} leaves, rank {root} has {len(ref)}")
    diff = next(((s, r) for s, r in zip(sig, ref) if s != r), None)
    if diff is not None:
      (path, shape, dtype), (rpath, rshape, rdtype) = diff
      details.append(f"rank {rank} leaf {path} {shape} {dtype} vs rank {root} leaf {rpath}"
                     f" {rshape} {rdtype}")
    if len(details) == before:
      details.append(f"rank {rank} nests its containers differently from rank {root}")
  raise ValueError(
      f"{caller}: every rank must pass a tree with the same containers, structure, shapes"
      f" and dtypes; the tree of rank(s) {differing} differs from rank {root}'s:"
      f" {'; '.join(details)}. Build the tree the same way on every rank (the same model,"
      " input shapes and metrics, the same list/tuple/dict types) before the call; nothing"
      " was exchanged.")


def is_number(dtype: Any) -> bool:
  """Whether host collectives can sum values of `dtype` (booleans count, as 0 and 1)."""
  dtype = np.dtype(dtype)
  return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def check_numbers(tree: Any, caller: str, *, floats_only: bool = False) -> None:
  """Raises `TypeError` naming the first leaf of `tree` that is not a number (or, with
  `floats_only`, not a real float). Call it after `check_same_tree`, so that every rank
  raises.

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


def fuse(arrays: Sequence[np.ndarray], dtype: Any = None) -> np.ndarray:
  """A new 1-D buffer: the arrays raveled, cast to `dtype` (default: the first one's), end
  to end. The inverse of `split`.

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
  """The reduction (`op`) over ranks of every array, in its own dtype: one fused buffer
  and one MPI call per dtype, in first-appearance order. Collective; no checks (every rank
  must pass the same shapes and dtypes: see `check_same_tree`). The inputs are not changed.

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


def _sum_dtype(dtype: np.dtype) -> np.dtype:
  """Exact host sums: integers and booleans in int64, floats in float64, complex in
  complex128; anything else stays itself (and `check_numbers` refuses it)."""
  if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer):
    return np.dtype(np.int64)
  if jnp.issubdtype(dtype, jnp.number):
    return np.result_type(dtype, np.float64)
  return dtype


def allreduce(tree: Any, comm: Communicator, *, caller: str = "allreduce",
              floats_only: bool = False) -> Any:
  """The sum over all ranks of every leaf of `tree`, exactly: integers and booleans as
  int64, floats as float64 (16-bit ones too), complex as complex128.

  Host-level and collective: call it on every rank, outside `jax.jit`. The structure,
  shapes and kinds of the leaves are checked on every rank first (`check_same_tree`), then
  that they are numbers (`check_numbers`).

  Args:
    tree: pytree of scalars or arrays (jax arrays are fetched to the host).
    comm: the `Communicator`.
    caller: the public function on whose behalf it runs, for the messages.
    floats_only: refuse leaves that are not real floats.

  Returns:
    The same structure holding numpy arrays (0-d for scalars) of the global sums.

  Example:
    >>> totals = allreduce({"n": True, "x": np.ones(2, np.float32)}, comm)
    >>> int(totals["n"]) == comm.size, totals["n"].dtype, totals["x"].dtype
    (True, dtype('int64'), dtype('float64'))
  """
  check_communicator(comm, caller)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [np.asarray(leaf) for leaf in leaves]
  arrays = [a.astype(_sum_dtype(a.dtype), copy=False) for a in arrays]
  as_summed = jax.tree_util.tree_unflatten(treedef, arrays)
  check_same_tree(as_summed, comm, caller)
  check_numbers(jax.tree_util.tree_unflatten(treedef, leaves), caller, floats_only=floats_only)
  return jax.tree_util.tree_unflatten(treedef, reduce_arrays(arrays, comm))


def broadcast(tree: Any, comm: Communicator, root: int = 0) -> Any:
  """Returns `root`'s copy of `tree` on every rank (host-level; call outside `jax.jit`).

  Use it once at start-up so every replica begins from identical parameters and optimizer
  state. Every rank passes a tree of the same structure, shapes and dtypes (e.g. parameters
  initialised from any seed) with the same containers (a list everywhere, not a tuple on
  some rank), and the same `root`; otherwise a `ValueError` naming the ranks and the first
  difference is raised on every rank and nothing is transferred. A tree holding
  `mnjax.shard_optimizer`'s state is refused (each rank's share differs by design):
  broadcast the parameters and build that state from them on every rank.

  Args:
    tree: pytree of arrays (jax or numpy) or scalars.
    comm: the `Communicator`.
    root: the rank whose values everyone receives.

  Returns:
    A pytree like `tree`; jax arrays come back as jax arrays, everything else as numpy.

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
  # One round checks the root and the tree: a rank with another root would wait in its own
  # Bcast (a hang) or take another rank's bytes (a silent wrong result).
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
  # Host transfers move raw bytes, so every numpy dtype travels as itself.
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
  """The mean over ranks of every float leaf of `tree` (ChainerMN's ``AllreducePersistent``);
  integer and bool leaves pass through unchanged, checked to be equal on every rank.

  For running statistics of per-rank ``nn.BatchNorm`` layers (which drift apart across
  ranks): call it on the ``batch_stats`` collection before evaluating or saving, so every
  rank holds the same averaged statistics. Host-level and collective (call on every rank);
  the tree's structure, shapes and dtypes are checked on every rank first, and a mismatch
  raises the same error everywhere. Sums run in float64; each leaf keeps its dtype, and jax
  arrays come back as jax arrays.

  Integer and bool leaves (counters such as ``num_batches_tracked``) are not averaged, as
  ChainerMN skips integer persistents; but where they differ between ranks, a rank-0
  checkpoint or evaluation would silently use rank 0's: one more round (a 16-byte hash of
  their values, only when the tree has such leaves) raises a `ValueError` on every rank
  naming the first leaf that differs, before any value is averaged.

  Example:
    >>> stats = {"mean": jnp.full(2, float(comm.rank)), "count": np.int32(7)}  # per rank
    >>> stats = mnjax.allreduce_persistent(stats, comm)  # before evaluating or saving
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
  totals = reduce_arrays([arrays[i].astype(_sum_dtype(arrays[i].dtype)) for i in averaged], comm)
  out = list(leaves)
  for i, total in zip(averaged, totals):
    mean = (total / comm.size).astype(arrays[i].dtype)
    out[i] = jnp.asarray(mean) if isinstance(leaves[i], jax.Array) else mean
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_equal_leaves(named: list[tuple[str, np.ndarray]], comm: Communicator,
                        caller: str) -> None:
  """Raises the same `ValueError` on every rank unless every rank holds equal values in
  these ``(path, array)`` leaves (one hash round; the digests travel only on a mismatch)."""
  digests = tuple(hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=8).hexdigest()
                  for _, a in named)
  shown = tuple(a.tolist() if a.size <= 4 else f"{a.dtype}{list(a.shape)} hashing to {d}"
                for (_, a), d in zip(named, digests))
  everyone = gather_if_different(comm, (digests, shown), what=f"{caller}'s check of its"
                                 " integer leaves")
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
