"""The round every host collective starts with: every rank's value compared, cheaply.

`gather_if_different` is one allgather of a 16-byte hash; the values themselves travel only
on a mismatch, and then every rank holds all of them, so every rank can raise the same
error instead of corrupting memory or hanging. `check_same_tree` is that round on a tree's
containers and signature (`mnjax.comm._signature`) and the call's arguments: what
`broadcast`, the host sums and many checks run before anything moves. The wait is
departure-aware (`mnjax.comm._wait`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from mnjax.comm import _recorder as recorder
from mnjax.comm._communicator import Communicator
from mnjax.comm._signature import tree_containers, tree_signature
from mnjax.comm._wait import wait

__all__ = ["check_same_tree", "gather_if_different"]

_HASH_BYTES = 16


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
    wait(comm, comm.mpi_comm.Iallgather(mine, everyone), what, timeout=timeout,
         timeout_message=timeout_message)
  if (everyone == everyone[0]).all():
    return None
  return comm.mpi_comm.allgather(value)


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
