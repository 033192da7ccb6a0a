"""Per-leaf BLAKE2b digests of shape, dtype and bytes: is a tree bitwise the same, leaf by leaf?"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mnjax.comm._communicator import Communicator
from mnjax.comm._host import _objects as objects
from mnjax.comm._host._signature import leaf_paths

__all__ = ["compare_across_ranks", "compare_digests", "leaf_digest", "tree_digests"]


def leaf_digest(array: Any, digest_size: int = 16) -> str:
  """The hex BLAKE2b digest (`digest_size` bytes) of one array's shape, dtype and bytes.

  Example:
    >>> len(leaf_digest(np.zeros(3), digest_size=8))
    16
  """
  array = np.asarray(array)
  h = hashlib.blake2b(digest_size=digest_size)
  h.update(f"{array.shape}{array.dtype.str}".encode())
  h.update(np.ascontiguousarray(array).view(np.uint8).data)
  return h.hexdigest()


def tree_digests(tree: Any, *, digest_size: int = 16,
                 copies: Callable[[Any], Sequence[np.ndarray]] | None = None
                 ) -> dict[str, list[str]]:
  """``{leaf path: [digest of each copy]}``; `copies(leaf)` lists the copies (default: the leaf).

  Example:
    >>> tree_digests({"w": np.zeros(2)}, digest_size=8)      # 16 hex digits per copy
    {"['w']": ['...']}
  """
  copies = copies or (lambda leaf: [leaf])
  return {path: [leaf_digest(copy, digest_size) for copy in copies(leaf)]
          for path, leaf in zip(leaf_paths(tree), jax.tree_util.tree_leaves(tree))}


def compare_digests(reference: Mapping[str, Sequence[str]],
                    other: Mapping[str, Sequence[str]]) -> dict[str, str]:
  """The leaves, by sorted path, where a copy in `other` differs from `reference`'s first:
  ``"lacks it"``, ``"has it"``, ``""`` (its one copy differs) or ``"device [1, 3]"``.

  Example:
    >>> compare_digests({"['w']": ["ab"]}, {"['w']": ["ab", "cd"]})
    {"['w']": 'device [1]'}
  """
  out = {}
  for path in sorted(set(reference) | set(other)):
    ref, digests = reference.get(path, []), other.get(path, [])
    if not ref or not digests:
      out[path] = "lacks it" if not digests else "has it"
      continue
    differing = [i for i, digest in enumerate(digests) if digest != ref[0]]
    if differing:
      out[path] = f"device {differing}" if len(digests) > 1 else ""
  return out


def compare_across_ranks(mine: Mapping[str, Sequence[str]], comm: Communicator, *,
                         operation: str = "check_replicas") -> tuple[dict[str, list[str]], int]:
  """Every rank's digests compared with rank 0's (collective, one host round named
  `operation`; the same result everywhere):
  ``({leaf path: ["rank 2", "rank 0 device [1]", ...]}, rank 0's leaf count)``, {} if all agree.

  Example:
    >>> compare_across_ranks(tree_digests({"w": np.zeros(2), "b": np.ones(2)}), comm)
    ({}, 2)
  """
  everyone = objects.allgather_obj(dict(mine), comm, operation=operation)
  reference = everyone[0]
  differing: dict[str, list[str]] = {}
  for rank, theirs in enumerate(everyone):
    for path, how in compare_digests(reference, theirs).items():
      differing.setdefault(path, []).append(f"rank {rank} {how}".rstrip())
  return differing, len(reference)
