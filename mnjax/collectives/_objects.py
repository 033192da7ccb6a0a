"""Host-side collectives on picklable objects (ChainerMN's ``comm.send_obj``, ``bcast_obj``,
``gather_obj``, ``allreduce_obj``).

For what is not an array: a configuration, a vocabulary, per-rank evaluation records. Each
object is pickled (highest protocol) and moves as bytes in pieces MPI can count
(`mnjax.collectives._transport`): an object above MPI's 2**31 - 1 bytes travels whole, where
mpi4py's own pickled calls fail on MPI-3 libraries (ChainerMN chunks its ``bcast_obj`` for
this reason; here every object collective does).

The collectives first agree on the operation, the root and every object's pickled size
(`mnjax.collectives._agreement`): another root, or an object that does not pickle on some
rank, is the same `ValueError` on every rank, before any byte moves.
"""

from __future__ import annotations

import functools
import operator
import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.collectives import _transport as transport
from mnjax.collectives._agreement import check_call, describe_root, everyone, ranks_text
from mnjax.comm._communicator import Communicator, check_communicator

__all__ = ["allreduce_obj", "bcast_obj", "gather_obj", "recv_obj", "send_obj"]


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


def send_obj(obj: Any, comm: Communicator, dest: int, tag: int = 0) -> None:
  """Sends the picklable `obj` to rank `dest` (ChainerMN's ``comm.send_obj``), which receives
  it with `recv_obj`. Blocking: returns once `dest` has begun receiving.

  Example:
    >>> if comm.size > 1 and comm.rank == 0:
    ...   comm.send_obj({"vocab": ["a", "b"]}, dest=1)
    >>> if comm.size > 1 and comm.rank == 1:
    ...   vocab = comm.recv_obj(source=0)["vocab"]
  """
  check_communicator(comm, "send_obj")
  tag = transport.check_tag(tag, "send_obj")
  dest = transport.check_peer(comm, dest, "dest", "send_obj")
  payload, body = _pickled(obj)
  if payload is None:
    raise TypeError(f"send_obj: {body[1]}; send arrays with send.")
  transport.send_message(comm, "object", None, payload, dest, tag, "send_obj")


def recv_obj(comm: Communicator, source: int, tag: int | None = None) -> Any:
  """The object rank `source` sent with `send_obj` (with `tag`; None: any tag, as ChainerMN).

  Example:
    >>> if comm.size > 1 and comm.rank == 1:
    ...   obj = mnjax.collectives.recv_obj(comm, source=0)   # doctest: +SKIP
  """
  check_communicator(comm, "recv_obj")
  tag = MPI.ANY_TAG if tag is None else transport.check_tag(tag, "recv_obj")
  source = transport.check_peer(comm, source, "source", "recv_obj")
  kind, _, payload, got = transport.recv_message(comm, source, tag, "recv_obj")
  if kind != "object":
    raise TypeError(f"recv_obj: rank {source} sent arrays (send) with tag {got}, not a pickled"
                    " object: receive them with recv (or send objects with send_obj).")
  return pickle.loads(payload.tobytes())


def bcast_obj(obj: Any, comm: Communicator, root: int = 0) -> Any:
  """`root`'s picklable `obj` on every rank (ChainerMN's ``comm.bcast_obj``); the other
  ranks' `obj` is ignored (pass None). Any size: it moves in pieces MPI can count.
  Collective.

  Example:
    >>> config = {"lr": 0.1} if comm.rank == 0 else None
    >>> comm.bcast_obj(config, root=0)
    {'lr': 0.1}
  """
  check_communicator(comm, "bcast_obj")
  is_root = describe_root(root) == ("int", comm.rank)
  payload, body = _pickled(obj) if is_root else (None, ("ignored",))
  described = everyone(comm, ("bcast_obj", describe_root(root), transport.MAX_MESSAGE_BYTES,
                              body), "bcast_obj's check of the root and its object")
  root = check_call(described, "bcast_obj", comm.size)
  bodies = [d[3] for d in described]
  _check_pickled(bodies, [root], "bcast_obj")
  if comm.size == 1:
    return obj
  buf = payload if comm.rank == root else np.empty(bodies[root][1], np.uint8)  # root: read only
  transport.bcast_bytes(buf, comm, root, transport.MAX_MESSAGE_BYTES)
  return obj if comm.rank == root else pickle.loads(buf.tobytes())


def _allgathered(obj: Any, comm: Communicator, caller: str, root: int | None) -> list | None:
  """Every rank's pickled `obj` (unpickled), by rank: on every rank (`root` None) or on
  `root` only (None elsewhere)."""
  payload, body = _pickled(obj)
  described = everyone(comm, (caller, None if root is None else describe_root(root),
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


def gather_obj(obj: Any, comm: Communicator, root: int = 0) -> list | None:
  """Every rank's picklable `obj`, in a list by rank, on `root` (None elsewhere; ChainerMN's
  ``comm.gather_obj``). Collective.

  Example:
    >>> got = comm.gather_obj({"rank": comm.rank}, root=0)
    >>> got if comm.rank == 0 else [{"rank": 0}]
    [{'rank': 0}]
  """
  check_communicator(comm, "gather_obj")
  return _allgathered(obj, comm, "gather_obj", root)


def allreduce_obj(obj: Any, comm: Communicator) -> Any:
  """The sum (``+``, in rank order) of every rank's picklable `obj`, on every rank
  (ChainerMN's ``comm.allreduce_obj``, MPI's SUM on objects): numbers, arrays, lists to
  concatenate, `collections.Counter`s. Every rank adds the same values in the same order, so
  every rank gets the same result (or the same error). Collective.

  Example:
    >>> comm.allreduce_obj(1) == comm.size
    True
    >>> comm.allreduce_obj([comm.rank]) == list(range(comm.size))
    True
  """
  check_communicator(comm, "allreduce_obj")
  return functools.reduce(operator.add, _allgathered(obj, comm, "allreduce_obj", None))
