"""What every rank passed to a host collective, known to every rank before anything moves.

The collectives of this package (and `split`) legitimately take different values on
different ranks (a color, a shape per rank, the root's object), so the ranks cannot just
compare one hash as `mnjax.broadcast` does. Each rank instead *describes* its call — the
operation, its root, the shape and dtype of each array, the size of each pickled object,
and any local problem (an argument of the wrong type, an object that does not pickle) — and
`everyone` gives each rank the list of all the descriptions, by rank. Every rank then
validates the same list with the same code, so a mismatch raises the same error on every
rank, naming the ranks, before any payload moves; and since every rank plans the transfer
from the same list (its sizes, its number of chunks), no two ranks can issue a different
number of MPI calls.

Cost: one allgather of a 16-byte hash when the descriptions are equal everywhere
(`mnjax.comm._agreement.gather_if_different`, departure-aware: a rank that finished its program
meanwhile is named, not waited for), plus one allgather of the small descriptions otherwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator
from mnjax.comm._host import gather_if_different

__all__ = [
    "array_signature", "check_call", "check_rank", "describe_root", "everyone", "listed",
    "ranks_text", "to_dtype",
]


def everyone(comm: Communicator, mine: Any, what: str) -> list[Any]:
  """Every rank's `mine`, by rank (collective over ``comm.mpi_comm``). `mine` must have a
  deterministic ``repr`` (tuples of numbers and strings).

  Example:
    >>> everyone(comm, ("bcast", 0), "bcast") == [("bcast", 0)] * comm.size
    True
  """
  gathered = gather_if_different(comm, mine, what=what)
  return [mine] * comm.size if gathered is None else gathered


def array_signature(x: Any) -> tuple[str, tuple[int, ...], str] | tuple[str, str]:
  """``("array", shape, dtype)`` for an array or a number; ``("bad", type name)`` for
  anything else (described, not raised: every rank raises once all descriptions are in).

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
  """``("int", root)``, or ``("bad", repr)`` for a root that is not an int (described, not
  raised, like every argument: see `check_call`).

  Example:
    >>> describe_root(0), describe_root("0")
    (('int', 0), ('bad', "'0'"))
  """
  if isinstance(root, (int, np.integer)) and not isinstance(root, bool):
    return ("int", int(root))
  return ("bad", repr(root)[:40])


def check_call(described: list[tuple], caller: str, size: int) -> int | None:
  """Raises the same `ValueError` on every rank unless every rank's ``(op, root, limit,
  body)`` description names the same operation, the same valid root (``None``: the
  operation has none) and the same message limit. Returns the root.

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
        " MPI calls. Set mnjax.collectives._transport.MAX_MESSAGE_BYTES the same on every"
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
