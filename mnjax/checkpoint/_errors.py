"""The errors of `mnjax.Checkpointer`, each raised on every rank alike."""

from __future__ import annotations

__all__ = ["CheckpointSaveError", "CheckpointTemplateError", "CorruptCheckpointError"]


class CorruptCheckpointError(RuntimeError):
  """No checkpoint in the directory could be read back intact."""


class CheckpointTemplateError(ValueError):
  """An intact checkpoint holds another tree than the template it is restored into."""


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (raised on every rank)."""
