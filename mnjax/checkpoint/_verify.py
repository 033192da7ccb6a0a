"""Each checkpoint's per-leaf digests (BLAKE2b, 128-bit): saved with it, compared on read."""

from __future__ import annotations

from typing import Any

from mnjax.comm._host._digest import compare_digests, tree_digests

__all__ = ["damaged", "record_digests"]


def record_digests(tree: Any) -> dict[str, str]:
  """``{leaf path: 128-bit digest}`` of a host tree, as saved in each checkpoint's record.

  Example:
    >>> saved = record_digests({"w": np.arange(3.0)})
    >>> list(saved), len(saved["['w']"])
    (["['w']"], 32)
  """
  return {path: digest for path, (digest,) in tree_digests(tree, digest_size=16).items()}


def damaged(saved: dict[str, str], state: Any) -> list[str]:
  """The leaves of `state` (read back) whose digest is not the one `saved` with it.

  Example:
    >>> saved = record_digests({"w": np.arange(3.0)})
    >>> damaged(saved, {"w": np.arange(3.0)}), damaged(saved, {"w": np.ones(3)})
    ([], ["['w']"])
  """
  # Older records name the one leaf of a state that is a bare array '' rather than '<root>'.
  saved = {path or "<root>": [digest] for path, digest in saved.items()}
  return list(compare_digests(saved, tree_digests(state, digest_size=16)))
