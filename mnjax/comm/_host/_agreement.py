"""The round every host collective starts with: every rank's value compared by hash, or every
rank's call described and validated alike (docs/design/failures.md)."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from mnjax.comm._host._signature import tree_containers, tree_signature
from mnjax.comm._host._wait import wait
from mnjax.comm._instep import _recorder as recorder
from mnjax.comm._instep._entry_tag import world_ranks

__all__ = ["array_signature", "check_call", "check_rank", "check_same_operation",
    "check_same_tree", "describe_root", "everyone", "gather_if_different", "group_note", "listed",
    "ranks_text", "to_dtype"]

_HASH_BYTES = 16


def gather_if_different(comm: Any, operation: str, value: Any, *,
                        timeout: float | None = None, timeout_message: str = "",
                        what: str = "a host collective") -> list[Any] | None:
  """None when every rank passed an equal `value` (by ``repr``) to the same `operation`, else
  every rank's value. Different operations: `ValueError`; past `timeout` (default
  ``MNJAX_WAIT_TIMEOUT``): `TimeoutError`.

  Example:
    >>> gather_if_different(comm, "my_check", tree_signature({"w": np.zeros(3)})) is None
    True
  """
  if comm.size == 1:
    return None
  record = (operation, value)
  mine = np.frombuffer(
      hashlib.blake2b(repr(record).encode(), digest_size=_HASH_BYTES).digest(), np.uint8)
  everyone = np.empty((comm.size, _HASH_BYTES), np.uint8)
  with recorder.host_span("pre-flight check", bytes=_HASH_BYTES):
    wait(comm, comm.mpi_comm.Iallgather(mine, everyone), what, timeout=timeout,
         timeout_message=timeout_message)
  if (everyone == everyone[0]).all():
    return None
  records = comm.mpi_comm.allgather(record)
  check_same_operation([r[0] for r in records], comm.mpi_comm)
  return [r[1] for r in records]


def check_same_operation(operations: list[str], mpi_comm: Any) -> None:
  """The same `ValueError` on every rank unless `operations` (by rank) are all the same.

  Example:
    >>> check_same_operation(["broadcast", "bcast_obj"], MPI.COMM_SELF)
    Traceback (most recent call last):
    ...
    ValueError: the ranks reached different mnjax rounds at the same point: rank 0 in ...
  """
  if len(set(operations)) == 1:
    return
  world = (MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(len(operations))),
                                     MPI.COMM_WORLD.Get_group())
           if len(operations) == mpi_comm.Get_size() else list(range(len(operations))))
  shown = ", ".join(
      f"rank {r}{f' (world rank {w})' if w != r else ''} in {op!r}"
      for r, (op, w) in enumerate(zip(operations, world)))
  raise ValueError(
      f"the ranks reached different mnjax rounds at the same point: {shown}. Every rank must"
      " call mnjax's collectives, checks and steps in the same order: look for a condition"
      " on comm.rank, a loop or a model that differs between ranks around these calls."
      " Nothing was exchanged.")


def check_same_tree(tree: Any, comm: Any, caller: str, *, root: int = 0,
                    arguments: dict[str, Any] | None = None) -> None:
  """Raises `ValueError` on every rank unless every rank's tree matches rank `root`'s
  (containers, structure, shapes, dtypes) and `arguments` are equal (by ``repr``). Collective.

  Example:
    >>> check_same_tree({"mean": np.zeros(3)}, comm, "my_average")  # before moving it
  """
  arguments = {name: repr(value) for name, value in (arguments or {}).items()}
  everyone = gather_if_different(comm, caller,
                                 (arguments, tree_containers(tree), tree_signature(tree)),
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


def everyone(comm: Any, operation: str, mine: Any, what: str) -> list[Any]:
  """Every rank's `mine` (deterministic ``repr``), by rank, once all are in `operation`.

  Example:
    >>> everyone(comm, "bcast", ("bcast", 0), "bcast's check") == [("bcast", 0)] * comm.size
    True
  """
  gathered = gather_if_different(comm, operation, mine, what=what)
  return [mine] * comm.size if gathered is None else gathered


def array_signature(x: Any) -> tuple[str, tuple[int, ...], str] | tuple[str, str]:
  """``("array", shape, dtype)`` for an array or a number, else ``("bad", type name)``.

  Example:
    >>> array_signature(jnp.zeros((2, 3))), array_signature("x")
    (('array', (2, 3), 'float32'), ('bad', 'str'))
  """
  if isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
    return ("array", tuple(int(d) for d in np.shape(x)), str(np.asarray(x).dtype))
  return ("bad", type(x).__name__)


def to_dtype(name: str) -> np.dtype:
  """The numpy dtype named by `array_signature` (``bfloat16`` too).

  Example:
    >>> to_dtype("bfloat16").itemsize
    2
  """
  return np.dtype(jnp.dtype(name))


def group_note(mpi_comm: Any) -> str:
  """'' for the job's own ranks; else each rank's world rank, for messages about a group.

  Example:
    >>> group_note(MPI.COMM_WORLD)
    ''
  """
  world = world_ranks(mpi_comm)
  if world == tuple(range(len(world))):
    return ""
  shown = ", ".join(f"rank {r} is world rank {w}" for r, w in enumerate(world[:16]))
  return (f" (The ranks above count the {len(world)} ranks of a group of the job's"
          f" {MPI.COMM_WORLD.Get_size()}: {shown}{', ...' if len(world) > 16 else ''}.)")


def ranks_text(ranks: list[int]) -> str:
  """``rank 2`` or ``ranks [0, 2]``, for messages.

  Example:
    >>> ranks_text([1]), ranks_text([0, 2])
    ('rank 1', 'ranks [0, 2]')
  """
  return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def listed(values: list[Any], name: str) -> str:
  """``rank 0 root=0, rank 1 root=1``: what each rank passed, for messages.

  Example:
    >>> listed([0, 1], "root")
    'rank 0 root=0, rank 1 root=1'
  """
  return ", ".join(f"rank {rank} {name}={value}" for rank, value in enumerate(values))


def check_rank(value: Any, size: int) -> bool:
  """Whether `value` names a rank of a communicator of `size` ranks (an int, not a bool).

  Example:
    >>> check_rank(1, 2), check_rank(2, 2), check_rank(True, 2)
    (True, False, False)
  """
  return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
          and 0 <= value < size)


def describe_root(root: Any) -> tuple:
  """``("int", root)``, or ``("bad", repr)`` for a root that is not an int.

  Example:
    >>> describe_root(0), describe_root("0")
    (('int', 0), ('bad', "'0'"))
  """
  if isinstance(root, (int, np.integer)) and not isinstance(root, bool):
    return ("int", int(root))
  return ("bad", repr(root)[:40])


def check_call(described: list[tuple], caller: str, size: int) -> int | None:
  """The root (None: the operation has none); the same `ValueError` on every rank unless the
  ``(op, root, limit, body)`` descriptions agree on the operation, a valid root and the limit.

  Example:
    >>> check_call([("bcast", ("int", 0), 8, ())] * comm.size, "bcast", comm.size)
    0
  """
  ops = [d[0] for d in described]
  if len(set(ops)) > 1:
    shown = ", ".join(f"rank {r} called {op}" for r, op in enumerate(ops))
    raise ValueError(
        f"{caller}: the ranks reached different host collectives at the same point ({shown})."
        " Every rank must call the same collectives in the same order: look for a condition"
        " on comm.rank around one of them; nothing was exchanged.")
  limits = [d[2] for d in described]
  if len(set(limits)) > 1:
    raise ValueError(
        f"{caller}: the ranks split messages at different sizes"
        f" ({listed(limits, 'MAX_MESSAGE_BYTES')}), so they would issue different numbers of"
        " MPI calls. Set mnjax.comm._host._transport.MAX_MESSAGE_BYTES the same on every"
        " rank (or leave it alone); nothing was exchanged.")
  roots = [d[1] for d in described]
  if roots[0] is None:
    return None
  if len(set(roots)) > 1:
    shown = listed([r[1] for r in roots], "root")
    raise ValueError(
        f"{caller}: every rank must pass the same root, but {shown}. Pass one value on every"
        " rank (a constant, not one computed from comm.rank); nothing was exchanged.")
  kind, root = roots[0]
  if kind != "int" or not 0 <= root < size:
    raise ValueError(
        f"{caller}: root must be a rank in [0, {size}), got {root}; pass root=0 for the first"
        " rank. Nothing was exchanged.")
  return root
