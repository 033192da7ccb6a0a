"""The in-step collectives a step issues, noted while it is traced (for the pre-flight check).

Every rank must issue the same in-step collectives in the same order, with the same shapes,
or a rank waits forever in a collective nobody else issued (or MPI mixes unrelated buffers).
While a step is traced inside `recording` (`mnjax.data_parallel` opens it around the step),
every mnjax collective of the step notes itself here: each `mnjax.SyncBatchNorm` layer's
statistics and each bucket of `allreduce_tree` (so of `mnjax.allreduce_gradients`). The
whole sequence is one fingerprint of the step, which `mnjax.guard._preflight` compares
across ranks once per trace. Noting costs nothing at run time: it happens while tracing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["note_collective", "recording", "recording_open"]


class _Recordings(threading.local):
  """The sequences being recorded by the open `recording` blocks of this thread."""

  def __init__(self):
    self.open: list[list[tuple]] = []


_RECORDINGS = _Recordings()


def note_collective(what: str, shape: Any, dtype: Any) -> None:
  """Notes an in-step collective being traced (`what`: e.g. the layer's path) in every open
  `recording`; nothing when none is open.

  Example:
    >>> with recording() as log:
    ...   note_collective("SyncBatchNorm layer BatchNorm_0", (3, 16), "float32")
    >>> log
    [('SyncBatchNorm layer BatchNorm_0', (3, 16), 'float32')]
  """
  for log in _RECORDINGS.open:
    log.append((what, tuple(int(d) for d in shape), str(dtype)))


def recording_open() -> bool:
  """Whether a `recording` is open on this thread (a step is traced under the check).

  Example:
    >>> with recording():
    ...   recording_open()
    True
  """
  return bool(_RECORDINGS.open)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
  """The list of collectives `note_collective` notes while the block runs (a step traced).

  Example:
    >>> with recording() as log:
    ...   pass                    # e.g. out = fn(*args), while tracing the step
    >>> log
    []
  """
  log: list[tuple] = []
  _RECORDINGS.open.append(log)
  try:
    yield log
  finally:
    _RECORDINGS.open.pop()
