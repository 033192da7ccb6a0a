"""`Checkpointer`: the collective side of a checkpoint (checks, gathers, errors on every rank).

Rank 0 writes and reads through `_store`; `_per_rank`, `_sharded` and `_own_state` check and
gather the state. Design: docs/design/checkpoints.md."""

from __future__ import annotations

import os
from typing import Any

import jax

from mnjax.checkpoint import _own_state as own
from mnjax.checkpoint import _per_rank as per_rank
from mnjax.checkpoint import _sharded as sharded
from mnjax.checkpoint import _verify as verify
from mnjax.checkpoint._errors import (
  CheckpointSaveError,
  CheckpointTemplateError,
  CorruptCheckpointError,
)
from mnjax.checkpoint._store import OrbaxStore
from mnjax.checkpoint._template import (
  like,
  signature,
  structure,
  target,
  template_difference,
  to_host,
)
from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host import _objects as objects
from mnjax.comm._host._broadcast import broadcast

__all__ = ["CheckpointSaveError", "CheckpointTemplateError", "Checkpointer",
           "CorruptCheckpointError"]


class Checkpointer:
  """Saves and restores training state in `directory` (collective: every rank calls it).

  Args:
    directory: one subdirectory per step, written by rank 0.
    keep: how many of the newest checkpoints to keep (>= 1).
    async_save: rank 0 writes in the background; the next `save`, `wait` or `close` waits
      for it (a failure is a `CheckpointSaveError` on every rank).
    settings: JSON values a resumed run must share (e.g. batch size, seed), checked on restore.

  Example:
    >>> import tempfile
    >>> state = {"w": jnp.zeros(3), "step": 0}
    >>> ckpt = mnjax.Checkpointer(tempfile.mkdtemp(), comm, keep=3, settings={"seed": 0})
    >>> restored = ckpt.restore(state)            # None when there is nothing to resume
    >>> step, state, meta = restored or (0, state, {"epoch": 1})
    >>> ckpt.save(step + 1, state, meta={"epoch": 1, "batch": 0})
    >>> ckpt.close()
  """

  def __init__(self, directory: str | os.PathLike, comm: Communicator, *, keep: int = 3,
               async_save: bool = True, settings: dict | None = None):
    check_communicator(comm, "Checkpointer")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
      raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}.")
    self.comm = comm
    self.directory = os.path.abspath(os.fspath(directory))
    self.settings = dict(settings or {})
    self.keep = keep
    self._async = async_save
    self._store: OrbaxStore | None = None  # rank 0 only: the other ranks never touch it
    problem = None
    if comm.is_root:
      try:
        self._store = OrbaxStore(self.directory, keep=keep, async_save=async_save)
      except OSError as error:  # a file in the way, a read-only or missing parent
        problem = f"{type(error).__name__}: {error}"
    problem = objects.bcast_obj(problem, comm, 0, operation="Checkpointer's directory check")
    if problem is not None:
      raise OSError(
          f"Checkpointer: rank 0 cannot use {self.directory} as the checkpoint directory"
          f" ({problem}). Pass a directory rank 0 may create and write (not a file, not under"
          " a file); nothing was written.")

  def save(self, step: int, state: Any, *, meta: dict | None = None) -> None:
    """Saves `state` as checkpoint `step` (collective; rank 0 writes; replaces that step).

    Args:
      step: the global step count, equal on every rank.
      state: a pytree of arrays, scalars, PRNG keys, `shard_optimizer` states, `PerRankState` s.
      meta: JSON-serialisable extras restored with it (epoch, data position).

    Raises:
      ValueError: on every rank, when the ranks' steps, sharded or per-rank states, leaves or
        `meta` differ, or mid `accumulate_gradients` cycle.
    """
    step = int(step)
    state = own.own_inner_states(self.comm, state)  # local_sgd's inner states: every rank's
    steps = objects.allgather_obj(step, self.comm, operation="Checkpointer.save")
    if len(set(steps)) > 1:
      raise ValueError(
          f"Checkpointer.save: the ranks are saving different steps {steps}; every rank"
          " must call save at the same step (replicas are identical only at equal steps).")
    wrong = (sharded.check(self.comm, state, "Checkpointer.save")
             or own.check(self.comm, state, "Checkpointer.save")
             or per_rank.mid_cycle(self.comm, state)
             or per_rank.differences(self.comm, state, meta))  # every rank: one allgather
    if wrong:
      raise ValueError(f"{wrong} Nothing was saved.")
    wholes = sharded.gather(self.comm, state)  # every rank: the shares go to rank 0
    parts = own.gather(self.comm, state, to_host)  # every rank: its own parts go to rank 0
    problem = None
    if self._store is not None:
      problem = self._store.finish_pending()
      if problem is None:
        try:
          self._start(step, state, wholes, parts, meta)
        except Exception as error:  # noqa: BLE001 (reported on every rank below)
          problem = (f"checkpoint {step} could not be started: {type(error).__name__}:"
                     f" {str(error)[:500]}")
        else:
          problem = None if self._async else self._store.finish_pending()
    self._raise_on_every_rank(problem)

  def _start(self, step: int, state: Any, wholes: list[Any], parts: list[Any],
             meta: dict | None) -> None:
    """Rank 0: hands checkpoint `step` to orbax, per-rank nodes replaced by `wholes`, `parts`."""
    host = own.expand(sharded.host_tree(state, wholes, to_host), parts)
    record = {"step": step, "meta": meta or {}, "settings": self.settings,
              "digests": verify.record_digests(host), "signature": signature(host),
              "structure": structure(host)}
    self._store.write(step, host, record)

  def _raise_on_every_rank(self, problem: str | None) -> None:
    """Rank 0's `problem` (a failed write) as `CheckpointSaveError` on every rank."""
    if problem is not None and self.comm.is_root:
      try:
        on_disk = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
      except OSError as error:
        on_disk = f"unknown ({error})"
      problem = (f"Checkpointer: {problem} (in {self.directory}, by rank 0). The checkpoints"
                 f" on disk are steps {on_disk}. Free space or fix the error, then rerun with"
                 " --resume (`resume`) to continue from the newest intact one.")
    problem = objects.bcast_obj(problem, self.comm, 0,
                                operation="Checkpointer's report of rank 0's write")
    if problem is not None:
      raise CheckpointSaveError(problem)

  def wait(self) -> None:
    """Blocks until rank 0's background write is on disk (collective); raises
    `CheckpointSaveError` on every rank if it failed."""
    self._raise_on_every_rank(self._store.finish_pending() if self._store is not None else None)

  def close(self) -> None:
    """Waits for the last write (as `wait`) and releases orbax's resources."""
    try:
      self.wait()
    finally:
      self._release()

  def _release(self) -> None:
    """Rank 0, no collective: waits for orbax and closes it; a failure goes to stderr."""
    if self._store is None:
      return
    self._store.close()
    self._store = None

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    # On an error, some ranks may never get here: close without a collective.
    if exc_type is None:
      self.close()
    else:
      self._release()

  def steps(self) -> list[int]:
    """The complete checkpoints rank 0 sees, oldest first (collective)."""
    steps = self._store.steps() if self._store is not None else None
    return objects.bcast_obj(steps, self.comm, 0, operation="Checkpointer.steps")

  def restore(self, template: Any) -> tuple[int, Any, dict] | None:
    """The newest intact checkpoint as ``(step, state, meta)`` on every rank; None if none.

    Collective: rank 0 reads from the newest down, skipping damaged ones (said on stderr).

    Args:
      template: a pytree like the saved state: its structure, shapes and dtypes are checked,
        and each value comes back as its leaf's kind (jax array on its sharding, numpy, PRNG
        key, scalar); a `shard_optimizer` state gets this rank's share, from any rank count.

    Raises (on every rank):
      CorruptCheckpointError: checkpoints exist but none reads back intact.
      CheckpointTemplateError: the newest readable one holds another tree than `template`.
      ValueError: the checkpoint was saved with other ``settings``.
    """
    wrong = (sharded.check(self.comm, template, "Checkpointer.restore")
             or own.check(self.comm, template, "Checkpointer.restore"))
    if wrong:
      raise CheckpointTemplateError(
          f"{wrong} Nothing was loaded. Build the template's optimizer state with"
          " shard_optimizer(tx, comm).init(params) for this job's communicator.")
    template = own.own_inner_states(self.comm, template)
    original = template
    template = own.whole_template(self.comm, template)  # every rank's PerRankState parts
    shards, template = template, sharded.whole_template(template)  # as written on disk
    outcome: Any = None
    state = None
    if self._store is not None:
      outcome, state = self._store.newest(template)
    outcome = objects.bcast_obj(outcome, self.comm, 0, operation="Checkpointer.restore")
    if isinstance(outcome, str):
      raise CorruptCheckpointError(outcome)
    if outcome is None:
      return None
    changed = {k: (outcome.get("settings", {}).get(k), v) for k, v in self.settings.items()
               if outcome.get("settings", {}).get(k) != v}
    if changed:  # before the tree: another setting often means another state layout too
      raise ValueError(
          f"Checkpointer.restore: checkpoint {outcome['step']} in {self.directory} was saved"
          f" with other settings (saved, now): {changed}. Resume with the saved settings, or"
          " start a new run in another directory.")
    self._check_template(outcome, template)
    if state is None:  # not rank 0: receive into buffers shaped like the saved leaves
      state = target(template, outcome["signature"])
    state = broadcast(state, self.comm, root=0)
    state = jax.tree.map(like, state, template)
    state = own.pick(self.comm, sharded.reshard(state, shards, like), original, like)
    return outcome["step"], own.without_own_inner_states(state), outcome["meta"]

  def resume(self, template: Any, *, requested: bool) -> tuple[int, Any, dict] | None:
    """`restore` when `requested`; else None (start from `template`), or `FileExistsError` on
    every rank if checkpoints exist.

    Example:
      >>> restored = ckpt.resume(state, requested=args.resume)  # doctest: +SKIP
      >>> step, state, meta = restored or (0, state, {"epoch": 1})  # doctest: +SKIP
    """
    if requested:
      return self.restore(template)
    existing = self.steps()
    if existing:
      raise FileExistsError(
          f"{self.directory} already holds checkpoints (steps {existing}). Pass --resume to"
          " continue that run, or choose a new --workdir; nothing was overwritten.")
    return None

  def _check_template(self, record: dict, template: Any) -> None:
    """`CheckpointTemplateError` on every rank unless every rank's `template` matches."""
    try:
      mine = template_difference(record, template)
    except Exception as error:  # noqa: BLE001 (every rank must reach the allgather)
      mine = f"{type(error).__name__}: {error}"
    every = objects.allgather_obj(mine, self.comm,
                                  operation="Checkpointer.restore's template check")
    wrong = [rank for rank, difference in enumerate(every) if difference]
    if wrong:
      raise CheckpointTemplateError(
          f"Checkpointer.restore: checkpoint {record['step']} in {self.directory} reads"
          " back (it is not damaged), but it holds a different tree than the template it"
          f" is restored into (on ranks {wrong} of {self.comm.size}): {every[wrong[0]]}."
          " Nothing was loaded and the checkpoint is untouched. Pass a template built like"
          " the saved state (the model, optimizer and state layout of the run that saved"
          " it), or start the new run in another directory.")
