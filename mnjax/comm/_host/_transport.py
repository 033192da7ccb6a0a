"""Bytes between ranks in pieces of at most `MAX_MESSAGE_BYTES` (MPI counts in ``int``s), as
many pieces on every rank: point-to-point, bcast, alltoallv."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mnjax.comm._host._agreement import check_rank
from mnjax.comm._host._wait import wait
from mnjax.comm._instep import _native as native

__all__ = [
    "MAX_MESSAGE_BYTES", "bcast_bytes", "check_peer", "check_tag", "exchange_bytes",
    "pieces", "recv_message", "send_message",
]

#: The most bytes one MPI call moves (MPI's int count limit); tests lower it.
MAX_MESSAGE_BYTES = 2**31 - 1


def pieces(nbytes: int, limit: int) -> list[slice]:
  """The byte ranges, each at most `limit` long, that cover `nbytes` (none for 0).

  Example:
    >>> pieces(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
  """
  return [slice(start, min(start + limit, nbytes)) for start in range(0, nbytes, limit)]


def bcast_bytes(buf: np.ndarray, comm: Any, root: int, limit: int) -> np.ndarray:
  """`root`'s bytes in `buf` (uint8, the same length on every rank), in place, in pieces.

  Example:
    >>> bcast_bytes(np.arange(5, dtype=np.uint8), comm, 0, limit=2).tolist()
    [0, 1, 2, 3, 4]
  """
  for piece in pieces(buf.size, limit):
    comm.mpi_comm.Bcast(buf[piece], root=root)
  return buf


def exchange_bytes(op: str, sends: Sequence[np.ndarray], recv_sizes: Sequence[int],
                   comm: Any, max_part: int, limit: int, root: int = 0
                   ) -> list[np.ndarray]:
  """The bytes from each rank (``recv_sizes[i]`` from rank ``i``). `op`: ``"alltoallv"``
  (``sends[j]`` to rank ``j``), ``"allgatherv"`` (``sends[0]`` to all) or ``"gatherv"`` (to
  `root`); `max_part`, the largest part any rank sends, fixes the number of rounds.

  Example:
    >>> [b.tolist() for b in exchange_bytes("allgatherv", [np.ones(3, np.uint8)], [3] * comm.size,
    ...                                     comm, 3, 8)] == [[1, 1, 1]] * comm.size
    True
  """
  step = max(1, limit // comm.size)
  rounds = pieces(max_part, step)
  received = ([np.empty(n, np.uint8) for n in recv_sizes] if len(rounds) > 1
              else [np.empty(0, np.uint8)] * len(recv_sizes))
  for round_ in rounds:
    start = round_.start
    scounts = [max(0, min(step, s.size - start)) for s in sends]
    rcounts = [max(0, min(step, n - start)) for n in recv_sizes]
    rdispls = _displacements(rcounts)
    rbuf = np.empty(sum(rcounts), np.uint8)
    received_here = [rbuf, (rcounts, rdispls), MPI.BYTE]
    if op == "alltoallv":
      sbuf = np.concatenate([s[start:start + c] for s, c in zip(sends, scounts)])
      comm.mpi_comm.Alltoallv([sbuf, (scounts, _displacements(scounts)), MPI.BYTE],
                              received_here)
    elif op == "allgatherv":  # as Alltoallv: MPICH's Allgatherv is slower here
      comm.mpi_comm.Alltoallv(
          [sends[0][start:start + scounts[0]], ([scounts[0]] * comm.size, [0] * comm.size),
           MPI.BYTE], received_here)
    else:
      comm.mpi_comm.Gatherv([sends[0][start:start + scounts[0]], MPI.BYTE],
                            received_here if comm.rank == root else None, root=root)
    if len(rounds) == 1:
      return [rbuf[offset:offset + count] for count, offset in zip(rcounts, rdispls)]
    for out, count, offset in zip(received, rcounts, rdispls):
      out[start:start + count] = rbuf[offset:offset + count]
  return received


def _displacements(counts: Sequence[int]) -> list[int]:
  return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def send_message(comm: Any, kind: str, meta: Any, payload: np.ndarray, dest: int,
                 tag: int, what: str) -> None:
  """Sends ``(kind, meta)`` and the uint8 `payload` to `dest` (see `recv_message`).

  Example:
    >>> send_message(comm, "object", None, np.zeros(3, np.uint8), 1, 0,  # doctest: +SKIP
    ...              "send_obj")
  """
  limit = MAX_MESSAGE_BYTES
  header = comm.mpi_comm.issend((kind, meta, int(payload.size), limit), dest=dest, tag=tag)
  limit_s = native.wait_timeout()
  wait(comm, header, f"{what} (to rank {dest}, tag {tag}, waiting for its receive)",
       peers=[dest], message=(comm.rank, dest, tag), timeout=limit_s, timeout_message=(
           f"{what}: rank {comm.rank} waited {limit_s:.0f} s for rank {dest} to receive its"
           f" message (tag {tag}), and rank {dest} took none. Make every send meet a recv"
           f" on the destination with the same tag (recv_obj's default takes any tag), or"
           f" raise the limit with {native.WAIT_TIMEOUT_ENV}=<seconds> if rank {dest} is"
           " only slow."))
  for piece in pieces(payload.size, limit):
    comm.mpi_comm.Send(payload[piece], dest=dest, tag=tag)


class _Probe:
  """A matched probe with MPI's ``Test()`` (so that `wait` can poll it)."""

  def __init__(self, mpi_comm: MPI.Comm, source: int, tag: int):
    self._args = (mpi_comm, source, tag)
    self.message: MPI.Message | None = None
    self.status = MPI.Status()

  def Test(self) -> bool:  # MPI's name
    mpi_comm, source, tag = self._args
    self.message = mpi_comm.improbe(source=source, tag=tag, status=self.status)
    return self.message is not None


def recv_message(comm: Any, source: int, tag: int, what: str
                 ) -> tuple[str, Any, np.ndarray, int]:
  """``(kind, meta, payload, tag)`` of `send_message`'s next message from `source` with `tag`.

  Example:
    >>> kind, meta, payload, tag = recv_message(comm, 0, MPI.ANY_TAG, "recv_obj")  # doctest: +SKIP
  """
  probe = _Probe(comm.mpi_comm, source, tag)
  shown = "any tag" if tag == MPI.ANY_TAG else f"tag {tag}"
  limit_s = native.wait_timeout()
  try:
    wait(comm, probe, f"{what} (from rank {source}, {shown})", peers=[source],
         message=(source, comm.rank, -1 if tag == MPI.ANY_TAG else tag), timeout=limit_s,
         timeout_message=f"{what}: rank {comm.rank} waited {limit_s:.0f} s")
  except TimeoutError:
    other = MPI.Status()
    pending = comm.mpi_comm.iprobe(source=source, tag=MPI.ANY_TAG, status=other)
    raise TimeoutError(
        f"{what}: rank {comm.rank} waited {limit_s:.0f} s for a message from rank {source}"
        f" ({shown}), and none came"
        + (f"; rank {source} sent one with tag {other.Get_tag()}, which this recv does not"
           " take" if pending else "")
        + ". Make every recv meet a send from its source with the same tag, or raise the"
        f" limit with {native.WAIT_TIMEOUT_ENV}=<seconds> if rank {source} is only slow."
    ) from None
  tag = probe.status.Get_tag()
  kind, meta, nbytes, limit = probe.message.recv()
  payload = np.empty(nbytes, np.uint8)
  for piece in pieces(nbytes, limit):
    comm.mpi_comm.Recv(payload[piece], source=source, tag=tag)
  return kind, meta, payload, tag


def check_peer(comm: Any, peer: Any, name: str, caller: str) -> int:
  """`peer` as a rank of `comm` other than this one, or a `ValueError` (local).

  Example:
    >>> check_peer(comm, comm.size, "dest", "send")
    Traceback (most recent call last):
    ...
    ValueError: send: dest must be a rank of the communicator other than this one ...
  """
  if not check_rank(peer, comm.size) or peer == comm.rank:
    raise ValueError(
        f"{caller}: {name} must be a rank of the communicator other than this one (rank"
        f" {comm.rank} of {comm.size}: one of"
        f" {[r for r in range(comm.size) if r != comm.rank]}), got {peer!r}. On a"
        " sub-communicator (comm.split), ranks count within the group.")
  return int(peer)


def check_tag(tag: Any, caller: str) -> int:
  """`tag` as an MPI tag (an int in [0, MPI.TAG_UB]), or a `ValueError`.

  Example:
    >>> check_tag(3, "send")
    3
  """
  upper = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
  if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool) or not 0 <= tag <= upper:
    raise ValueError(f"{caller}: tag must be an int in [0, {upper}] (MPI's tag range), got"
                     f" {tag!r}.")
  return int(tag)
