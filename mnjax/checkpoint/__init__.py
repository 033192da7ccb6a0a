"""Checkpoints that survive a killed job: atomic, asynchronous, verified on restore.

* `Checkpointer`: rank 0 writes (orbax), every rank restores and checks.
* `LoopCheckpoints`: a training loop's checkpoints, for a bitwise resume.
* `PerRankState`: a subtree (a model-parallel stage) each rank saves and restores as its own.
* Errors, raised on every rank: `CorruptCheckpointError`, `CheckpointTemplateError`,
  `CheckpointSaveError`. Design: docs/design/checkpoints.md.

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
