"""`OrbaxStore`: rank 0's orbax manager plus what orbax leaves out (checked background
writes, safe pruning, the newest intact step). No collective calls (docs/design/checkpoints.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import jax
import numpy as np

from mnjax.checkpoint import _verify as verify
from mnjax.checkpoint._template import target, template_difference

__all__ = ["OrbaxStore"]


class OrbaxStore:
  """Rank 0's orbax ``CheckpointManager`` in `directory`, keeping the newest `keep`.

  Example:
    >>> import tempfile
    >>> store = OrbaxStore(tempfile.mkdtemp(), keep=2, async_save=False)
    >>> store.write(1, {"w": np.zeros(2)}, {"step": 1})
    >>> store.finish_pending(), store.steps()
    (None, [1])
    >>> store.close()
  """

  def __init__(self, directory: str, *, keep: int, async_save: bool):
    import orbax.checkpoint as ocp  # noqa: PLC0415 (heavy; rank 0 only)

    self.directory = directory
    self.keep = keep
    self._pending: int | None = None  # the step whose write is not yet checked
    # Under jax.distributed (kind 'xla') orbax would wait for every process: rank 0 alone.
    multiprocessing = (ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
                       if jax.process_count() > 1 else ocp.options.MultiprocessingOptions())
    os.makedirs(self.directory, exist_ok=True)
    self._ocp = ocp
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None, create=False, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True, multiprocessing_options=multiprocessing))

  def steps(self) -> list[int]:
    """The complete checkpoints in the directory, oldest first."""
    return sorted(self._manager.all_steps())

  def write(self, step: int, host: Any, record: dict) -> None:
    """Hands checkpoint `step` to orbax (call `finish_pending` first); raises as orbax."""
    args = self._ocp.args
    if step in self._manager.all_steps():  # an earlier attempt's (e.g. one skipped as damaged)
      self._manager.delete(step)
    # force: orbax would otherwise skip, without a word, any step not newer than its latest.
    self._manager.save(step, force=True, args=args.Composite(
        state=args.StandardSave(host), record=args.JsonSave(record)))
    self._pending = step

  def finish_pending(self) -> str | None:
    """Waits for the pending write; what went wrong with it, or None."""
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as error:  # noqa: BLE001 (reported on every rank by the caller)
      cause = f"{type(error).__name__}: {str(error)[:500]}"
    else:
      if step is None:
        return None
      if os.path.isdir(os.path.join(self.directory, str(step))):
        return self.prune(step)
      # Orbax logs a failed background write (a full disk, say) and carries on.
      cause = "the background write did not complete (orbax logged the cause on stderr)"
    with contextlib.suppress(Exception):  # this error is the one to report
      self._manager.reload()  # forget the step orbax listed but never published
    return f"{'a checkpoint' if step is None else f'checkpoint {step}'} was not written: {cause}"

  def prune(self, step: int) -> str | None:
    """Deletes all but the newest ``keep`` checkpoints (`step` is on disk)."""
    try:
      for old in sorted(self._manager.all_steps())[:-self.keep]:
        self._manager.delete(old)
    except Exception as error:  # noqa: BLE001 (reported on every rank by the caller)
      return (f"checkpoint {step} is on disk, but deleting an older one failed:"
              f" {type(error).__name__}: {str(error)[:500]}")
    return None

  def close(self) -> None:
    """Waits for orbax and closes it; a failed write goes to stderr."""
    problem = self.finish_pending()
    if problem is not None:
      sys.stderr.write(f"mnjax.Checkpointer: {problem}\n")
    self._manager.close()

  def newest(self, template: Any) -> tuple[Any, Any]:
    """(record, state) of the newest intact step; (None, None) with no steps, (message,
    None) when all are damaged, (record, None) when the record does not match `template`."""
    steps = sorted(self._manager.all_steps(), reverse=True)
    problems = []
    args = self._ocp.args

    def skip(step: int, error: Exception) -> None:
      problems.append(f"step {step}: {type(error).__name__}: {str(error)[:300]}")
      sys.stderr.write(f"mnjax.Checkpointer: skipping checkpoint {self.directory}/{step}:"
                       f" {problems[-1]}\n")

    for step in steps:
      try:
        record = self._manager.restore(step, args=args.Composite(
            record=args.JsonRestore()))["record"]
        if record.get("step") != step:
          raise ValueError(f"its record names step {record.get('step')}")
        different = template_difference(record, template)
      except Exception as error:  # noqa: BLE001 (any read failure means: do not load it)
        skip(step, error)
        continue
      if different:  # not damage: no fallback past it
        return record, None
      try:
        buffers = target(template, record["signature"])
        state = self._manager.restore(step, args=args.Composite(
            state=args.StandardRestore(buffers)))["state"]
        state = jax.tree.map(np.asarray, state)
        bad = verify.damaged(record["digests"], state)
        if bad:
          raise ValueError(f"its bytes do not match the digests saved with it (leaves {bad[:5]})")
      except Exception as error:  # noqa: BLE001 (any read failure means: do not load it)
        skip(step, error)
        continue
      return record, state
    if not steps:
      return None, None
    return (f"Checkpointer.restore: none of the {len(steps)} checkpoints in {self.directory}"
            f" reads back intact: {'; '.join(problems)}. Nothing was loaded. Restore a copy"
            " of the directory, or move it away to start from scratch."), None
