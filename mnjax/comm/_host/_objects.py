"""Host-side collectives on picklable objects (ChainerMN's ``comm.send_obj``, ``bcast_obj``, ...),
pickled and moved in countable pieces (any size), each checked on every rank first."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.comm._host import _transport as transport
from mnjax.comm._host._agreement import check_call, describe_root, everyone, ranks_text

__all__ = ["allgather_obj", "allreduce_obj", "bcast_obj", "gather_obj", "recv_obj", "send_obj"]


def _pickled(obj: Any) -> tuple[np.ndarray | None, tuple]:
  """The pickled bytes of `obj` and their description, or ``(None, problem)``."""
  try:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  except Exception as error:  # noqa: BLE001 (described, then raised on every rank)
    return None, ("bad", f"{type(obj).__name__} that does not pickle"
                         f" ({type(error).__name__}: {str(error)[:200]})")
  return np.frombuffer(data, np.uint8), ("bytes", len(data))


def _check_pickled(bodies: list[tuple], ranks: list[int], caller: str) -> None:
  bad = [r for r in ranks if bodies[r][0] != "bytes"]
  if bad:
    raise ValueError(f"{caller}: {ranks_text(bad)} passed a {bodies[bad[0]][1]}; every object"
                     " must be picklable. Nothing was exchanged.")


def send_obj(obj: Any, comm: Any, dest: int, tag: int = 0) -> None:
  """Sends the picklable `obj` to rank `dest`'s `recv_obj`; returns once it begins receiving.

  Example:
    >>> if comm.size > 1 and comm.rank == 0:
    ...   comm.send_obj({"vocab": ["a", "b"]}, dest=1)
    >>> if comm.size > 1 and comm.rank == 1:
    ...   vocab = comm.recv_obj(source=0)["vocab"]
  """
  tag = transport.check_tag(tag, "send_obj")
  dest = transport.check_peer(comm, dest, "dest", "send_obj")
  payload, body = _pickled(obj)
  if payload is None:
    raise TypeError(f"send_obj: {body[1]}; send arrays with send.")
  transport.send_message(comm, "object", None, payload, dest, tag, "send_obj")


def recv_obj(comm: Any, source: int, tag: int | None = None) -> Any:
  """The object rank `source` sent with `send_obj` (with `tag`; None: any tag, as ChainerMN).

  Example:
    >>> if comm.size > 1 and comm.rank == 1:
    ...   obj = comm.recv_obj(source=0)                     # doctest: +SKIP
  """
  tag = MPI.ANY_TAG if tag is None else transport.check_tag(tag, "recv_obj")
  source = transport.check_peer(comm, source, "source", "recv_obj")
  kind, _, payload, got = transport.recv_message(comm, source, tag, "recv_obj")
  if kind != "object":
    raise TypeError(f"recv_obj: rank {source} sent arrays (send) with tag {got}, not a pickled"
                    " object: receive them with recv (or send objects with send_obj).")
  return pickle.loads(payload.tobytes())


def bcast_obj(obj: Any, comm: Any, root: int = 0, *, operation: str = "bcast_obj") -> Any:
  """`root`'s picklable `obj` on every rank (the others pass None), any size. Collective.

  `operation` names the round in errors (mnjax's own rounds pass theirs: a rank elsewhere is
  told which round the others are in), and every rank waits in it as in every host round
  (bounded, a departed peer named).

  Example:
    >>> config = {"lr": 0.1} if comm.rank == 0 else None
    >>> comm.bcast_obj(config, root=0)
    {'lr': 0.1}
  """
  is_root = describe_root(root) == ("int", comm.rank)
  payload, body = _pickled(obj) if is_root else (None, ("ignored",))
  described = everyone(comm, operation,
                       (operation, describe_root(root), transport.MAX_MESSAGE_BYTES, body),
                       f"{operation}'s check of the root and its object")
  root = check_call(described, operation, comm.size)
  bodies = [d[3] for d in described]
  _check_pickled(bodies, [root], operation)
  if comm.size == 1:
    return obj
  buf = payload if comm.rank == root else np.empty(bodies[root][1], np.uint8)  # root: read only
  transport.bcast_bytes(buf, comm, root, transport.MAX_MESSAGE_BYTES)
  return obj if comm.rank == root else pickle.loads(buf.tobytes())


def _allgathered(obj: Any, comm: Any, caller: str, root: int | None) -> list | None:
  """Every rank's `obj`, by rank: on every rank (`root` None) or on `root` (None elsewhere)."""
  payload, body = _pickled(obj)
  described = everyone(comm, caller, (caller, None if root is None else describe_root(root),
                              transport.MAX_MESSAGE_BYTES, body),
                       f"{caller}'s check of every rank's object")
  root = check_call(described, caller, comm.size)
  bodies = [d[3] for d in described]
  _check_pickled(bodies, list(range(comm.size)), caller)
  if comm.size == 1:
    return [pickle.loads(payload.tobytes())]
  sizes = [b[1] for b in bodies]
  receives = root is None or comm.rank == root
  got = transport.exchange_bytes("allgatherv" if root is None else "gatherv", [payload],
                                 sizes if receives else [0] * comm.size, comm, max(sizes),
                                 transport.MAX_MESSAGE_BYTES, root or 0)
  return [pickle.loads(g.tobytes()) for g in got] if receives else None


def allgather_obj(obj: Any, comm: Any, *, operation: str = "allgather_obj") -> list:
  """Every rank's picklable `obj`, in a list by rank, on every rank; `operation` as in
  `bcast_obj`.

  Example:
    >>> allgather_obj(comm.rank, comm, operation="my round") == list(range(comm.size))
    True
  """
  return _allgathered(obj, comm, operation, None)


def gather_obj(obj: Any, comm: Any, root: int = 0) -> list | None:
  """Every rank's picklable `obj`, in a list by rank, on `root` (None elsewhere).

  Example:
    >>> got = comm.gather_obj({"rank": comm.rank}, root=0)
    >>> got if comm.rank == 0 else [{"rank": 0}]
    [{'rank': 0}]
  """
  return _allgathered(obj, comm, "gather_obj", root)


def allreduce_obj(obj: Any, comm: Any) -> Any:
  """The sum (``+``, in rank order) of every rank's picklable `obj`, on every rank (collective).

  Example:
    >>> comm.allreduce_obj(1) == comm.size
    True
    >>> comm.allreduce_obj([comm.rank]) == list(range(comm.size))
    True
  """
  every = _allgathered(obj, comm, "allreduce_obj", None)
  total = every[0]
  for rank, value in enumerate(every[1:], start=1):
    try:
      total = total + value
    except TypeError as error:  # the same on every rank: each holds every rank's object
      kinds = ", ".join(f"rank {r}: {type(v).__name__}" for r, v in enumerate(every))
      raise TypeError(
          f"allreduce_obj: rank {rank}'s object cannot be added to the sum of the ranks before"
          f" it ({error}); the ranks passed {kinds}. Pass objects of one type that `+`"
          " combines (numbers, arrays, lists, collections.Counter) on every rank.") from None
  return total
