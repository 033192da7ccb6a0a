"""Host-side collectives on arrays (ChainerMN's ``comm.send``, ``bcast``, ``gather``, ...), as
raw bytes (every dtype keeps its bits), each checked on every rank before any byte moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mnjax.comm._host import _transport as transport
from mnjax.comm._host._agreement import (
  array_signature,
  check_call,
  describe_root,
  everyone,
  ranks_text,
  to_dtype,
)

__all__ = ["allgather", "alltoall", "bcast", "gather", "recv", "scatter", "send"]


def _bytes(x: Any) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _array(buf: np.ndarray, shape: tuple[int, ...], dtype: str) -> np.ndarray:
  return np.ascontiguousarray(buf).view(to_dtype(dtype)).reshape(shape)


def _nbytes(signature: tuple) -> int:
  _, shape, dtype = signature
  return int(np.prod(shape, dtype=np.int64)) * to_dtype(dtype).itemsize


def send(x: Any, comm: Any, dest: int, tag: int = 0) -> None:
  """Sends the pytree of arrays `x` to rank `dest`'s `recv`; returns once it begins receiving.

  Example:
    >>> if comm.size > 1 and comm.rank == 0:        # rank 0 -> rank 1
    ...   comm.send({"h": np.ones((2, 3), np.float32)}, dest=1, tag=7)
    >>> if comm.size > 1 and comm.rank == 1:
    ...   got = comm.recv(source=0, tag=7)           # {'h': array of shape (2, 3)}
  """
  tag = transport.check_tag(tag, "send")
  dest = transport.check_peer(comm, dest, "dest", "send")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  signatures = [array_signature(leaf) for leaf in leaves]
  bad = [i for i, s in enumerate(signatures) if s[0] == "bad"]
  if bad:
    raise TypeError(f"send: every leaf must be an array or a number, but leaf {bad[0]} is a"
                    f" {signatures[bad[0]][1]}; send other objects with send_obj.")
  payload = (np.concatenate([_bytes(leaf) for leaf in leaves]) if leaves
             else np.empty(0, np.uint8))
  transport.send_message(comm, "arrays", (treedef, signatures), payload, dest, tag, "send")


def recv(comm: Any, source: int, tag: int = 0) -> Any:
  """What rank `source` sent with `send` and `tag`: the same pytree, of numpy arrays.

  Example:
    >>> if comm.size > 1 and comm.rank == 1:
    ...   x = comm.recv(source=0, tag=7)                     # doctest: +SKIP
  """
  tag = transport.check_tag(tag, "recv")
  source = transport.check_peer(comm, source, "source", "recv")
  kind, meta, payload, _ = transport.recv_message(comm, source, tag, "recv")
  if kind != "arrays":
    raise TypeError(f"recv: rank {source} sent a pickled object (send_obj) with tag {tag}, not"
                    " arrays: receive it with recv_obj (or send arrays with send).")
  treedef, signatures = meta
  out, offset = [], 0
  for signature in signatures:
    n = _nbytes(signature)
    out.append(_array(payload[offset:offset + n], signature[1], signature[2]))
    offset += n
  return jax.tree_util.tree_unflatten(treedef, out)


def bcast(x: Any, comm: Any, root: int = 0) -> np.ndarray:
  """`root`'s array on every rank; the others pass None or an array like it (collective).

  Example:
    >>> x = np.arange(3.0) if comm.rank == 0 else None
    >>> comm.bcast(x, root=0).tolist()
    [0.0, 1.0, 2.0]
  """
  body = ("none",) if x is None else array_signature(x)
  described = everyone(comm, "bcast",
                       ("bcast", describe_root(root), transport.MAX_MESSAGE_BYTES, body),
                       "bcast's check of every rank's root, shape and dtype")
  root = check_call(described, "bcast", comm.size)
  bodies = [d[3] for d in described]
  reference = bodies[root]
  if reference[0] != "array":
    raise ValueError(f"bcast: root {root} must pass an array, got"
                     f" {'None' if reference[0] == 'none' else reference[1]}; nothing was"
                     " exchanged.")
  wrong = [r for r, b in enumerate(bodies) if b[0] != "none" and b != reference]
  if wrong:
    shown = "; ".join(f"rank {r} passed {_shown(bodies[r])}" for r in wrong[:4])
    raise ValueError(
        f"bcast: the other ranks pass None or an array like root {root}'s"
        f" ({_shown(reference)}), but {shown}. Pass None where you only receive; nothing was"
        " exchanged.")
  buf = _bytes(x).copy() if comm.rank == root else np.empty(_nbytes(reference), np.uint8)
  if comm.size > 1:
    transport.bcast_bytes(buf, comm, root, transport.MAX_MESSAGE_BYTES)
  return _array(buf, reference[1], reference[2])


def _shown(body: tuple) -> str:
  if body[0] == "array":
    return f"shape {body[1]} {body[2]}"
  return "None" if body[0] == "none" else f"a {body[1]}"


def _same_dtype(bodies: list[tuple], caller: str, what: str = "array") -> None:
  """The same `ValueError` on every rank unless every body is an array, all of one dtype."""
  bad = [r for r, b in enumerate(bodies) if b[0] != "array"]
  if bad:
    raise ValueError(f"{caller}: every rank must pass an {what}, but {ranks_text(bad)} passed"
                     f" {_shown(bodies[bad[0]])}; nothing was exchanged.")
  dtypes = [b[2] for b in bodies]
  if len(set(dtypes)) > 1:
    shown = ", ".join(f"rank {r} {d}" for r, d in enumerate(dtypes))
    raise ValueError(
        f"{caller}: every {what} must have the same dtype (shapes may differ), but {shown}."
        " Cast them to one dtype first; nothing was exchanged.")


def _exchange(comm: Any, op: str, sends: list[np.ndarray], recv_sizes: list[int],
              every_size: list[int], root: int = 0) -> list[np.ndarray]:
  return transport.exchange_bytes(op, sends, recv_sizes, comm, max(every_size, default=0),
                                  transport.MAX_MESSAGE_BYTES, root)


def gather(x: Any, comm: Any, root: int = 0) -> tuple[np.ndarray, ...] | None:
  """Every rank's array (shapes may differ, one dtype), by rank, on `root`; None elsewhere.

  Example:
    >>> got = comm.gather(np.full(2, comm.rank), root=0)
    >>> [a.tolist() for a in got] if comm.rank == 0 else got   # on rank 0, one per rank
    [[0, 0]]
  """
  described = everyone(
      comm, "gather",
      ("gather", describe_root(root), transport.MAX_MESSAGE_BYTES, array_signature(x)),
      "gather's check of every rank's root and dtype")
  root = check_call(described, "gather", comm.size)
  bodies = [d[3] for d in described]
  _same_dtype(bodies, "gather")
  sizes = [_nbytes(b) for b in bodies]
  if comm.size == 1:
    return (np.array(x),)
  got = _exchange(comm, "gatherv", [_bytes(x)], sizes if comm.rank == root else [0] * comm.size,
                  sizes, root)
  if comm.rank != root:
    return None
  return tuple(_array(g, b[1], b[2]) for g, b in zip(got, bodies))


def allgather(x: Any, comm: Any) -> tuple[np.ndarray, ...]:
  """Every rank's array (shapes may differ, one dtype), by rank, on every rank.

  Example:
    >>> [a.tolist() for a in comm.allgather(np.full(2, comm.rank))] == [
    ...     [r, r] for r in range(comm.size)]
    True
  """
  described = everyone(comm, "allgather", ("allgather", None, transport.MAX_MESSAGE_BYTES,
                              array_signature(x)), "allgather's check of every rank's dtype")
  check_call(described, "allgather", comm.size)
  bodies = [d[3] for d in described]
  _same_dtype(bodies, "allgather")
  sizes = [_nbytes(b) for b in bodies]
  mine = _bytes(x)
  got = _exchange(comm, "allgatherv", [mine], sizes, sizes) if comm.size > 1 else [mine.copy()]
  return tuple(_array(g, b[1], b[2]) for g, b in zip(got, bodies))


def _parts(xs: Any, size: int) -> tuple[list[Any] | None, tuple]:
  """`xs` as `size` parts (a sequence, or an array's first axis) and their description."""
  if isinstance(xs, (jax.Array, np.ndarray)) and np.ndim(xs) > 0:
    parts = [xs[i] for i in range(np.shape(xs)[0])]
  elif isinstance(xs, Sequence) and not isinstance(xs, (str, bytes)):
    parts = list(xs)
  else:
    return None, ("bad", f"a {type(xs).__name__}, not a sequence of arrays")
  if len(parts) != size:
    return None, ("bad", f"{len(parts)} parts for {size} ranks")
  signatures = tuple(array_signature(p) for p in parts)
  bad = [s for s in signatures if s[0] != "array"]
  if bad:
    return None, ("bad", f"a part that is a {bad[0][1]}")
  return parts, ("parts", signatures)


def _check_parts(bodies: list[tuple], ranks: list[int], caller: str, size: int) -> None:
  bad = [r for r in ranks if bodies[r][0] != "parts"]
  if bad:
    raise ValueError(
        f"{caller}: {ranks_text(bad)} passed {bodies[bad[0]][1]}; expected a sequence of"
        f" {size} arrays (one per rank of the communicator, comm.size == {size}) or an array"
        f" whose first axis has length {size}. Nothing was exchanged.")
  _same_dtype([s for r in ranks for s in bodies[r][1]], caller, "array part")


def alltoall(xs: Any, comm: Any) -> tuple[np.ndarray, ...]:
  """``xs[j]`` to rank ``j``; returns the parts sent here, by source rank. `xs`: ``comm.size``
  arrays (shapes may differ, one dtype) or an array with ``comm.size`` rows.

  Example:
    >>> xs = [np.full(2, 10 * comm.rank + j) for j in range(comm.size)]
    >>> [a.tolist() for a in comm.alltoall(xs)] == [
    ...     [10 * r + comm.rank] * 2 for r in range(comm.size)]
    True
  """
  parts, body = _parts(xs, comm.size)
  described = everyone(comm, "alltoall", ("alltoall", None, transport.MAX_MESSAGE_BYTES, body),
                       "alltoall's check of every rank's parts")
  check_call(described, "alltoall", comm.size)
  bodies = [d[3] for d in described]
  _check_parts(bodies, list(range(comm.size)), "alltoall", comm.size)
  mine = [bodies[r][1][comm.rank] for r in range(comm.size)]  # what each rank sends me
  every = [_nbytes(s) for b in bodies for s in b[1]]
  sends = [_bytes(p) for p in parts]
  got = (_exchange(comm, "alltoallv", sends, [_nbytes(s) for s in mine], every) if comm.size > 1
         else [sends[0].copy()])
  return tuple(_array(g, s[1], s[2]) for g, s in zip(got, mine))


def scatter(xs: Any, comm: Any, root: int = 0) -> np.ndarray:
  """Part ``j`` of `root`'s `xs` (as for `alltoall`; None elsewhere) on rank ``j``.

  Example:
    >>> xs = np.arange(2 * comm.size).reshape(comm.size, 2) if comm.rank == 0 else None
    >>> comm.scatter(xs, root=0).tolist() == [2 * comm.rank, 2 * comm.rank + 1]
    True
  """
  is_root = describe_root(root) == ("int", comm.rank)
  parts, body = _parts(xs, comm.size) if is_root else (None, ("ignored",))
  described = everyone(comm, "scatter",
                       ("scatter", describe_root(root), transport.MAX_MESSAGE_BYTES, body),
                       "scatter's check of the root's parts")
  root = check_call(described, "scatter", comm.size)
  bodies = [d[3] for d in described]
  _check_parts(bodies, [root], "scatter", comm.size)
  signatures = bodies[root][1]
  mine = signatures[comm.rank]
  sizes = [_nbytes(s) for s in signatures]
  if comm.size == 1:
    return _array(_bytes(parts[0]).copy(), mine[1], mine[2])
  if comm.rank == root:
    sends = [_bytes(p) for p in parts]
  else:
    sends = [np.empty(0, np.uint8)] * comm.size
  recv_sizes = [_nbytes(mine) if r == root else 0 for r in range(comm.size)]
  got = _exchange(comm, "alltoallv", sends, recv_sizes, sizes)
  return _array(got[root], mine[1], mine[2])
