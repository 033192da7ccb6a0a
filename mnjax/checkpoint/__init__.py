"""Checkpoints that survive a killed job: atomic, asynchronous, verified on restore.

* `Checkpointer`: orbax underneath; rank 0 writes, every rank restores and checks.
* `LoopCheckpoints`: the training loop's policy (every k steps, at the end of each epoch,
  keep n) and bitwise resume.

Example::

    ckpt = mnjax.checkpoint.Checkpointer("runs/exp/checkpoints", comm)
"""

from mnjax.checkpoint._checkpointer import Checkpointer, CorruptCheckpointError
from mnjax.checkpoint._loop import LoopCheckpoints

__all__ = ["Checkpointer", "CorruptCheckpointError", "LoopCheckpoints"]
