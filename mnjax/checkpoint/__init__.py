"""Checkpoints that survive a killed job: atomic, asynchronous, verified on restore.

* `Checkpointer`: orbax underneath; rank 0 writes, every rank restores and checks.
* `LoopCheckpoints`: the training loop's policy (every k steps, at the end of each epoch,
  keep n) and bitwise resume.
* `PerRankState`: a subtree that is each rank's own (a model-parallel stage): every rank's
  is saved, each rank restores its own.
* Errors, the same on every rank: `CorruptCheckpointError` (nothing reads back intact),
  `CheckpointTemplateError` (an intact checkpoint of another tree than the template),
  `CheckpointSaveError` (a write that did not reach the disk).

Example::

    ckpt = mnjax.checkpoint.Checkpointer("runs/exp/checkpoints", comm)
"""

from mnjax.checkpoint._checkpointer import (
    Checkpointer,
    CheckpointSaveError,
    CheckpointTemplateError,
    CorruptCheckpointError,
)
from mnjax.checkpoint._loop import LoopCheckpoints
from mnjax.checkpoint._own_state import PerRankState

__all__ = [
    "CheckpointSaveError",
    "CheckpointTemplateError",
    "Checkpointer",
    "CorruptCheckpointError",
    "LoopCheckpoints",
    "PerRankState",
]
