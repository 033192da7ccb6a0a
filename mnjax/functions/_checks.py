"""Argument checks of `mnjax.functions`; a problem that may differ per rank is refused on all."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep._compat import traced_for
from mnjax.comm._instep._primitives import mpi_datatype
from mnjax.functions import _transport as transport
from mnjax.functions._trace_check import HINT, INNER_JIT
from mnjax.guard import _pairing as pairing

__all__ = ["BODY", "checked", "communicator", "like_spec", "misplaced",
           "payload", "rank_problem", "refuse", "stand_in"]

#: Bodies that run a traced exchange zero or several times (`_compat.traced_for`'s names).
_BODIES = {"cond": "lax.cond", "switch": "lax.switch", "while_cond": "lax.while_loop",
           "while_body": "lax.while_loop", "scan": "lax.scan (or fori_loop)",
           "checkpoint": "jax.checkpoint"}

BODY = (
    "mnjax.functions.{caller}: called inside a {body}, which runs a traced exchange"
    " zero times (a branch not taken) or several times (a loop), so the ranks would not"
    " exchange what the pre-flight check paired (a hang). " + HINT)


def communicator(comm: Any, caller: str) -> Communicator:
  """`comm`, checked to be a ``flat`` `Communicator` on CPU devices.

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
        " jitted program per process; the multi-device kinds' step is a shard_map over the"
        " local devices, where each exchange would run once per device and pair per"
        " device). Instead: launch one process per device (mpirun -n <devices in the job>)"
        " with comm = mnjax.create_communicator('flat'), and for data x model parallelism"
        " split it: model_comm = comm.split(...) for the exchanges, data_comm ="
        " comm.split(...) for mnjax.allreduce_gradients (experiments/dual_parallel.py).")
  platforms = {d.platform for d in comm.devices}
  if platforms - {"cpu"}:
    raise NotImplementedError(
        f"mnjax.functions.{caller}: this process drives {sorted(platforms)} devices; the"
        " in-step exchanges run on CPU devices only (mnjax's native MPI handlers order a"
        " receive after the previous exchange; mpi4jax's GPU handlers cannot).")
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
  """Refuses a call: raises now at size 1, else notes it for the check to raise everywhere.

  Example:
    >>> refuse("mnjax.functions.send: bad dest", comm)
    Traceback (most recent call last):
    ...
    mnjax.guard._pairing.ExchangeError: mnjax.functions.send: bad dest.
  """
  if comm.size == 1:
    raise pairing.ExchangeError(problem + ".")
  transport.check_only(transport.record(comm, pairing.entry(problem, "refused", ()), (), ""))


def misplaced(caller: str) -> str | None:
  """Why an exchange must not be traced here (a control-flow body, an inner ``jax.jit``), or None.

  Example:
    >>> misplaced("send") is None
    True
  """
  outer = traced_for()
  inside = next((name for b in outer for key, name in _BODIES.items() if b.startswith(key)),
                None)
  if inside is not None:
    return BODY.format(caller=caller, body=inside)
  own = 2 if sequence.recording_open() else 1  # functions.jit: its jit and make_jaxpr's
  if "jit" in outer[:-own]:
    return INNER_JIT.format(caller=caller)
  return None


def stand_in(fn: Any, *args: Any) -> Any:
  """Zeros shaped like ``fn(*args)``'s result, issuing no exchange.

  Example:
    >>> stand_in(lambda x: x + 1, jnp.ones(2))
    Array([0., 0.], dtype=float32)
  """
  with transport.dry():
    shapes = jax.eval_shape(fn, *args)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def checked(rank: Any, comm: Communicator, name: str, caller: str, *, peer: bool) -> bool:
  """Whether `rank` is good; if not, the call is refused.

  Example:
    >>> checked(0, comm, "root", "bcast", peer=False)
    True
  """
  problem = rank_problem(rank, comm, name, caller, peer=peer)
  if problem is not None:
    refuse(problem, comm)
  return problem is None


def payload(x: Any, caller: str, name: str = "x") -> jax.Array:
  """`x` as a non-empty array MPI can move (no complex or object dtype).

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
  """The shape and dtype of `like` (an array or a ``jax.ShapeDtypeStruct``).

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
