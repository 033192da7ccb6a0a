"""Argument checks of `mnjax.functions`, and how a refusal reaches every rank.

A bad argument that every rank passes alike (a communicator of another kind, a `like` that
is no array) raises at once, on every rank. One that may differ per rank (a peer or root
outside the communicator, a rank sending to itself) must not raise on that rank alone
while the others go on to the pre-flight check and wait there: inside a checked step
(`mnjax.functions.jit`: a sequence is being recorded) the call
notes a *refusal* in the step's sequence and goes on with a stand-in result, and the
pre-flight check raises it on every rank (`mnjax.guard._pairing`). Outside one, on several
ranks, nothing could check the step, so the call is refused where it is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm import _sequence as sequence
from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._primitives import mpi_datatype
from mnjax.guard import _pairing as pairing

__all__ = ["checked", "communicator", "like_spec", "payload", "rank_problem", "refuse"]


def communicator(comm: Any, caller: str) -> Communicator:
  """`comm`, checked to be a ``flat`` `Communicator` on CPU devices, traced under a check.

  Example:
    >>> communicator(comm, "send") is comm
    True
  """
  comm = check_communicator(comm, caller)
  if comm.kind != "flat":
    raise ValueError(
        f"mnjax.functions.{caller}: the communicator is kind {comm.kind!r}"
        f" ({comm.local_device_count} device(s) per process); the in-step exchanges of"
        " mnjax.functions need one device per process, kind 'flat' (its step is one"
        " jitted program per process, which no shard_map over local devices splits)."
        " Create the model-parallel communicator with mnjax.create_communicator('flat').")
  platforms = {d.platform for d in comm.devices}
  if platforms - {"cpu"}:
    raise NotImplementedError(
        f"mnjax.functions.{caller}: this process drives {sorted(platforms)} devices; the"
        " in-step exchanges run on CPU devices only (mnjax's native MPI handlers order a"
        " receive after the previous exchange; mpi4jax's GPU handlers cannot).")
  if comm.size > 1 and not sequence.recording_open():
    raise RuntimeError(
        f"mnjax.functions.{caller} is traced across {comm.size} processes outside a checked"
        " step (e.g. under plain jax.jit), where no rank can check that every send meets"
        " its recv: a rank with another peer, shape or order would wait forever. Build the"
        " step with mnjax.functions.jit(step, comm) (jax.jit plus that check, once per"
        " trace).")
  return comm


def rank_problem(rank: Any, comm: Communicator, name: str, caller: str, *,
                 peer: bool) -> str | None:
  """What is wrong with `rank` as a peer (not this rank) or root of `comm`, or None.

  Example:
    >>> rank_problem(comm.size, comm, "dest", "send", peer=True)[:40]
    'mnjax.functions.send: dest=1 is not a ra'
  """
  if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
    return (f"mnjax.functions.{caller}: {name} must be an int (a rank of the communicator),"
            f" got {rank!r}")
  if not 0 <= rank < comm.size:
    return (f"mnjax.functions.{caller}: {name}={rank} is not a rank of the communicator"
            f" (ranks 0..{comm.size - 1}); pass a rank of the communicator the call uses")
  if peer and rank == comm.rank:
    return (f"mnjax.functions.{caller}: {name}={rank} is this rank itself; a rank cannot"
            " exchange with itself (it would wait for its own message)")
  return None


def refuse(problem: str, comm: Communicator) -> None:
  """Refuses a call: raises now on a size-1 communicator, else notes the refusal for the
  pre-flight check to raise on every rank (the caller then returns a stand-in).

  Example:
    >>> refuse("mnjax.functions.send: bad dest", comm)
    Traceback (most recent call last):
    ...
    mnjax.guard._pairing.ExchangeError: mnjax.functions.send: bad dest.
  """
  if comm.size == 1:
    raise pairing.ExchangeError(problem + ".")
  sequence.note_collective(pairing.entry(problem, "refused", ()), (), "")


def checked(rank: Any, comm: Communicator, name: str, caller: str, *, peer: bool) -> bool:
  """Whether `rank` is good; when not, the call is refused (`refuse`) and returns False.

  Example:
    >>> checked(0, comm, "root", "bcast", peer=False)
    True
  """
  problem = rank_problem(rank, comm, name, caller, peer=peer)
  if problem is not None:
    refuse(problem, comm)
  return problem is None


def payload(x: Any, caller: str, name: str = "x") -> jax.Array:
  """`x` as an array MPI can move (any dtype but complex and object), not empty.

  Example:
    >>> payload([1.0, 2.0], "send").dtype
    dtype('float32')
  """
  try:
    x = jnp.asarray(x)
  except TypeError as error:
    raise TypeError(f"mnjax.functions.{caller}: {name} must be an array, got"
                    f" {type(x).__name__} ({error}).") from None
  _check_dtype(x.dtype, x.shape, caller, name)
  return x


def like_spec(like: Any, caller: str, name: str = "like") -> jax.ShapeDtypeStruct:
  """The shape and dtype `like` gives (an array or a ``jax.ShapeDtypeStruct``).

  Example:
    >>> like_spec(jax.ShapeDtypeStruct((2, 3), jnp.float32), "recv").shape
    (2, 3)
  """
  shape, dtype = getattr(like, "shape", None), getattr(like, "dtype", None)
  if shape is None or dtype is None:
    raise TypeError(
        f"mnjax.functions.{caller}: {name} must be an array or a jax.ShapeDtypeStruct giving"
        f" the shape and dtype of what arrives, got {type(like).__name__} ({like!r}). E.g."
        f" {name}=jax.ShapeDtypeStruct((batch, 64), jnp.float32).")
  shape = tuple(int(d) for d in shape)
  _check_dtype(np.dtype(dtype), shape, caller, name)
  return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


def _check_dtype(dtype: np.dtype, shape: tuple, caller: str, name: str) -> None:
  if int(np.prod(shape, dtype=np.int64)) == 0:
    raise ValueError(f"mnjax.functions.{caller}: {name} has shape {tuple(shape)}, with no"
                     " element to exchange; exchange at least one element.")
  try:
    ok = not jnp.issubdtype(dtype, jnp.complexfloating)
    if ok:
      mpi_datatype(dtype)
  except Exception:  # noqa: BLE001 - mpi4jax's lookup raises several kinds
    ok = False
  if not ok:
    raise TypeError(f"mnjax.functions.{caller}: {name} has dtype {dtype}, which MPI cannot"
                    " move here; use a real float, integer or bool dtype.")
