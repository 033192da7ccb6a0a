"""A training loop's checkpoints: the train state plus where the loop stands.

Exact resume needs more than parameters and optimizer state: the epoch, the batch within
it (the data order is fixed by the seed and the epoch, so a position is enough) and the
metric sums the epoch has accumulated so far. `LoopCheckpoints` keeps those together on top
of `mnjax.Checkpointer`, as both experiment scripts use it:

    checkpoints = LoopCheckpoints(f"{workdir}/checkpoints", comm, resume=args.resume,
                                  settings={"seed": 0, "global_batch_size": 256})
    state, sums, first_epoch, first_batch = checkpoints.start(state, zero_sums)
    ...                                   # after step `step`, batch i of `epoch`:
    checkpoints.save(step, state, sums, epoch, i + 1)
    checkpoints.wait()                    # before recording an epoch: did the save land?

Metric sums are per rank; a checkpoint stores them summed over ranks, and on resume rank 0
carries them on while the others start from zero, so the epoch's global figures come out
the same whatever the number of ranks of the resumed run.
"""

from __future__ import annotations

from typing import Any

from mnjax.checkpoint._checkpointer import Checkpointer
from mnjax.comm import _host as host
from mnjax.comm._communicator import Communicator

__all__ = ["LoopCheckpoints"]


class LoopCheckpoints:
  """Checkpoints of ``(train state, epoch, batch, partial metric sums)`` (collective).

  Args:
    directory: where the checkpoints live.
    comm: the `Communicator`.
    resume: continue from the newest intact checkpoint; when False, a directory that
      already holds checkpoints is refused (`FileExistsError` on every rank).
    keep: how many checkpoints to keep.
    settings: values a resumed run must share with the saved one (see `Checkpointer`).

  Example:
    >>> state = {"w": jnp.zeros(3)}                     # e.g. a flax TrainState
    >>> checkpoints = LoopCheckpoints("runs/x/checkpoints", comm, resume=True)
    >>> state, sums, epoch, batch = checkpoints.start(state, {"loss_sum": 0.0, "count": 0})
    >>> epoch, batch                                      # nothing saved yet
    (1, 0)
    >>> checkpoints.save(10, state, {"loss_sum": 2.5, "count": 10}, epoch=1, batch=10)
    >>> checkpoints.close()
    >>> again = LoopCheckpoints("runs/x/checkpoints", comm, resume=True)  # a restarted job
    >>> again.start(state, sums)[1:]
    ({'count': 10, 'loss_sum': 2.5}, 1, 10)
  """

  def __init__(self, directory: str, comm: Communicator, *, resume: bool, keep: int = 3,
               settings: dict | None = None):
    self.comm = comm
    self.resume = resume
    self.checkpointer = Checkpointer(directory, comm, keep=keep, settings=settings)
    self._last_step: int | None = None

  def start(self, state: Any, zero_sums: Any) -> tuple[Any, Any, int, int]:
    """``(state, sums, epoch, batch)`` to start the loop from: the newest checkpoint's with
    ``resume``, else ``(state, zero_sums, 1, 0)``."""
    restored = self.checkpointer.resume({"train": state, "sums": zero_sums},
                                        requested=self.resume)
    if restored is None:
      self._last_step = None
      return state, zero_sums, 1, 0
    step, saved, meta = restored
    self._last_step = step
    sums = saved["sums"] if self.comm.is_root else zero_sums
    return saved["train"], sums, meta["epoch"], meta["batch"]

  def save(self, step: int, state: Any, sums: Any, epoch: int, batch: int) -> None:
    """Checkpoints `state` at `step`, to resume at batch `batch` of `epoch` (collective).
    A step already saved (an epoch's end that falls on a periodic save) is not saved twice."""
    if step == self._last_step:
      return
    self._last_step = step
    totals = host.allreduce(sums, self.comm, caller="LoopCheckpoints.save")
    self.checkpointer.save(step, {"train": state, "sums": totals},
                           meta={"epoch": epoch, "batch": batch})

  def wait(self) -> None:
    """Blocks until the last save is on disk (collective; the loop calls it before it
    records an epoch, so no record follows a lost save).

    Raises:
      mnjax.checkpoint.CheckpointSaveError: on every rank, when that save failed.
    """
    self.checkpointer.wait()

  def close(self) -> None:
    """Waits for the last write (collective, raises as `wait`) and closes the directory."""
    self.checkpointer.close()

  def __enter__(self) -> LoopCheckpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.checkpointer.__exit__(*exc)  # no collective when leaving on an error
