"""Replica consensus: are the parameters still bitwise identical? (docs/design/failures.md)"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host._digest import compare_across_ranks, tree_digests
from mnjax.comm._host._signature import shares_in

__all__ = ["check_replicas", "fingerprints"]


def _copies(leaf: Any) -> list[np.ndarray]:
  """This process's copies of `leaf`: one per addressable device, or the value itself."""
  if isinstance(leaf, jax.Array) and len(leaf.addressable_shards) > 1:
    return [np.asarray(shard.data) for shard in leaf.addressable_shards]
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    return [np.asarray(leaf.addressable_shards[0].data)]
  return [np.asarray(leaf)]


def fingerprints(tree: Any) -> dict[str, list[str]]:
  """``{leaf path: [hex digest per local copy]}`` (64-bit BLAKE2b of shape, dtype and bytes).

  Example:
    >>> fingerprints({"w": jnp.zeros(2)})       # 16 hex digits per local copy
    {"['w']": ['...']}
  """
  return tree_digests(tree, digest_size=8, copies=_copies)


def check_replicas(tree: Any, comm: Communicator, *, what: str = "parameters") -> None:
  """Raises `ValueError` on every rank unless `tree` is bitwise identical on all replicas.

  Collective, between steps; one host hash pass and a small allgather. `tree` must not hold
  `mnjax.shard_optimizer`'s state (refused); `what` names it in the message.

  Example:
    >>> params = {"w": jnp.zeros(3)}
    >>> mnjax.check_replicas(params, comm)   # e.g. every 500 steps; raises if they drifted
  """
  check_communicator(comm, "check_replicas")
  shares = shares_in(tree)
  if shares:  # local, and so on every rank: every rank holds its own share
    raise ValueError(
        f"check_replicas: the {what} hold mnjax.shard_optimizer's state at {shares[0]}"
        f"{f' (and {len(shares) - 1} more)' if len(shares) > 1 else ''}: each rank holds a"
        " different share of the optimizer state by design, so it cannot be compared across"
        " replicas. Compare what must be identical: check_replicas(params, comm) (the"
        " all-gathered updates keep the parameters identical), and any other replicated"
        " part of the state without the optimizer state. Nothing was compared.")
  differing, leaves = compare_across_ranks(fingerprints(tree), comm)
  if differing:
    listed = "; ".join(f"{path}: {', '.join(ranks)} differ from rank 0"
                       for path, ranks in list(differing.items())[:20])
    more = f" (and {len(differing) - 20} more leaves)" if len(differing) > 20 else ""
    raise ValueError(
        f"check_replicas: the {what} are no longer identical on every replica."
        f" {len(differing)} of {leaves} leaves differ: {listed}{more}. Replicas"
        " drift when ranks start from different values (broadcast from rank 0 after"
        " init or restore), apply different updates (every rank must run the same"
        " optimizer on the allreduced gradient) or the hardware flips bits. Restore the"
        " last checkpoint on every rank.")
