"""`LoopCheckpoints`: a training loop's checkpoints (docs/design/checkpoints.md)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mnjax.checkpoint._checkpointer import Checkpointer
from mnjax.comm._communicator import Communicator
from mnjax.comm._host import _broadcast as host

__all__ = ["LoopCheckpoints"]


def _widened(leaf: Any) -> Any:
  """A numpy sum widened as `save` writes it (int64, float64); other leaves as they are."""
  if isinstance(leaf, (np.ndarray, np.generic)):
    return leaf.astype(host.host_sum_dtype(leaf.dtype))
  return leaf


class LoopCheckpoints:
  """Checkpoints of ``(train state, epoch, batch, partial metric sums)`` (collective).

  Args:
    resume: continue from the newest intact checkpoint; when False, a directory that
      already holds checkpoints is a `FileExistsError` on every rank.
    keep, settings: as `Checkpointer`'s.
    per_replica: the sums hold one row per replica of this process (as
      ``allreduce_metrics(..., per_replica=True)`` takes them): saved as every replica's
      row, restored as this process's rows, so a run of ``replicas=V`` resumes on any
      number of processes with the sums it would have had.

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
               settings: dict | None = None, per_replica: bool = False):
    if not isinstance(per_replica, bool):
      raise TypeError(f"LoopCheckpoints: per_replica must be a bool, got {per_replica!r}.")
    self.comm = comm
    self.resume = resume
    self.per_replica = per_replica
    self.checkpointer = Checkpointer(directory, comm, keep=keep, settings=settings)
    self._last_step: int | None = None

  def start(self, state: Any, zero_sums: Any) -> tuple[Any, Any, int, int]:
    """``(state, sums, epoch, batch)`` to start from: the newest checkpoint's with ``resume``
    (the rank-summed sums on rank 0, zeros elsewhere; ``per_replica``: this process's rows
    on every rank), else ``(state, zero_sums, 1, 0)``."""
    saved_sums = jax.tree.map(_widened, zero_sums)
    if self.per_replica:  # every replica's row
      saved_sums = jax.tree.map(
          lambda z: np.zeros((self.comm.num_replicas, *np.shape(z)[1:]), np.asarray(z).dtype),
          saved_sums)
    restored = self.checkpointer.resume({"train": state, "sums": saved_sums},
                                        requested=self.resume)
    if restored is None:
      self._last_step = None
      return state, zero_sums, 1, 0
    step, saved, meta = restored
    self._last_step = step
    if self.per_replica:  # this process's rows, in the step's dtypes
      rows = self.comm.local_device_count
      mine = slice(self.comm.rank * rows, (self.comm.rank + 1) * rows)
      sums = jax.tree.map(lambda r, z: np.asarray(r)[mine].astype(np.asarray(z).dtype),
                          saved["sums"], zero_sums)
    else:
      sums = saved["sums"] if self.comm.is_root else zero_sums
    return saved["train"], sums, meta["epoch"], meta["batch"]

  def save(self, step: int, state: Any, sums: Any, epoch: int, batch: int) -> None:
    """Checkpoints `state` at `step`, to resume at batch `batch` of `epoch` (collective); a
    step already saved (an epoch's end on a periodic save) is not saved again."""
    if step == self._last_step:
      return
    self._last_step = step
    reduce = host.replica_rows if self.per_replica else host.allreduce
    totals = reduce(sums, self.comm, caller="LoopCheckpoints.save")
    self.checkpointer.save(step, {"train": state, "sums": totals},
                           meta={"epoch": epoch, "batch": batch})

  def wait(self) -> None:
    """Blocks until the last save is on disk (collective; call it before recording an epoch);
    raises `CheckpointSaveError` on every rank if it failed."""
    self.checkpointer.wait()

  def close(self) -> None:
    """Waits for the last write (collective, raises as `wait`) and closes the directory."""
    self.checkpointer.close()

  def __enter__(self) -> LoopCheckpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.checkpointer.__exit__(*exc)  # no collective when leaving on an error
