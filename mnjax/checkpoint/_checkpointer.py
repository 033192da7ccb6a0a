"""Checkpoints that can always be resumed: atomic, verified, the same step on every rank.

`Checkpointer` saves any pytree of training state — parameters, optimizer state (mnjax's
transformation states included), RNG keys, epoch and data position — with
orbax-checkpoint, and restores it exactly:

- **One writer.** Under plain ``mpirun`` every process is its own single-process JAX, so
  orbax cannot coordinate the ranks; replicas are identical anyway, so rank 0 writes and
  the others only check that they are saving the same step and the same values: state that
  differs between replicas (an unflushed double-buffered gradient, per-replica BatchNorm
  statistics, a per-rank key) would be lost on restore, and is refused on every rank with
  the fix (`mnjax.checkpoint._per_rank`). State that is each rank's own by design (a
  model-parallel stage) is wrapped in `PerRankState`: every rank's is written, in the same
  checkpoint, and each rank restores its own (`mnjax.checkpoint._own_state`).
- **Atomic.** Orbax writes into a temporary directory and renames it when complete; a save
  killed half-way is never listed, never loaded. The last ``keep`` checkpoints are kept; an
  older one is deleted only once the newer one is on disk (orbax would delete it even when
  the newer write fails, leaving none with ``keep=1``).
- **Verified.** Each checkpoint carries a BLAKE2b digest per leaf (`mnjax.checkpoint._verify`).
  A checkpoint that does not read back, or whose bytes no longer match (truncated,
  flipped), is reported and skipped in favour of the previous one; if none is readable,
  restore fails saying so (`CorruptCheckpointError`). It is never loaded silently. An intact
  checkpoint that holds another tree than the template is not damage: it is a
  `CheckpointTemplateError` naming the difference, and nothing falls back past it.
- **Same step everywhere.** Rank 0 chooses the step, reads it and broadcasts the state, so
  ranks with a stale or private view of the directory cannot resume from different steps.
- **Sharded optimizer state saved whole.** A `mnjax.optim.ShardedState` in the tree (what
  `mnjax.shard_optimizer` keeps: this rank's shares) is joined from every rank's shares and
  written whole, as ``gather_optimizer_state`` returns it, so the checkpoint does not depend
  on the number of ranks; a template holding a `ShardedState` gets this rank's share of it
  back, so a run saved on P ranks resumes on Q (`mnjax.checkpoint._sharded`). Digests are
  of the whole state, as on disk.

Saving is asynchronous by default: rank 0 copies the state to host memory and orbax writes
it in the background while training goes on. The next `save`, `wait` or `close` checks that
the write reached the disk (orbax only logs a failed background write) and raises
`CheckpointSaveError` on every rank if it did not. Rank 0's dealings with orbax (writes,
their check, pruning, reading the newest intact step) are `mnjax.checkpoint._store`'s; the
errors are in `mnjax.checkpoint._errors`.
"""

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
from mnjax.comm._host import broadcast

__all__ = ["CheckpointSaveError", "CheckpointTemplateError", "Checkpointer",
           "CorruptCheckpointError"]


class Checkpointer:
  """Saves and restores training state in `directory` (collective: every rank calls it).

  Args:
    directory: where checkpoints live (one subdirectory per step). Rank 0 must be able to
      write it; the other ranks never touch it.
    comm: the `Communicator`.
    keep: how many of the most recent checkpoints to keep (>= 1).
    async_save: write in a background thread (rank 0); the next `save`, `wait` or `close`
      waits for it and raises `CheckpointSaveError` on every rank if it failed.
    settings: JSON values a resumed run must share with the saved one (e.g. the global
      batch size and seed that fix the data order); saved with every checkpoint and
      compared by `resume`.

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
    if comm.is_root:
      self._store = OrbaxStore(self.directory, keep=keep, async_save=async_save)

  # -- save ----------------------------------------------------------------------------------

  def save(self, step: int, state: Any, *, meta: dict | None = None) -> None:
    """Saves `state` as checkpoint `step` (collective; rank 0 writes). An existing
    checkpoint of the same step (say, one a restore skipped as damaged) is replaced.

    Args:
      step: the global step count (equal on every rank, or `ValueError` on every rank).
      state: the pytree to save; jax arrays, numpy arrays, Python scalars and PRNG keys,
        and `shard_optimizer` states (saved whole: module docstring).
      meta: JSON-serialisable extras restored with it (epoch, data position, config).

    Raises:
      ValueError: on every rank, when the ranks save different steps, sharded optimizer
        states that are not each rank's own share of the same tree, an accumulate_gradients
        cycle half done, or leaves (or `meta`) that differ between replicas: rank 0's copy
        would be everyone's on restore (a double-buffered pending gradient must be flushed
        first, with `mnjax.train.flush_pending`).
    """
    step = int(step)
    steps = self.comm.mpi_comm.allgather(step) if self.comm.size > 1 else [step]
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
    """Rank 0: hands checkpoint `step` to orbax (the previous write is finished); `wholes`:
    the whole states of `state`'s sharded optimizer states (`sharded.gather`), `parts`:
    every rank's part of each `PerRankState` (`own.gather`)."""
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
    problem = self.comm.mpi_comm.bcast(problem, root=0) if self.comm.size > 1 else problem
    if problem is not None:
      raise CheckpointSaveError(problem)

  def wait(self) -> None:
    """Blocks until rank 0's background write, if any, is on disk (collective).

    Raises:
      CheckpointSaveError: on every rank, when that write failed.
    """
    self._raise_on_every_rank(self._store.finish_pending() if self._store is not None else None)

  def close(self) -> None:
    """Waits for the last write (as `wait`: collective, raises on every rank if it failed)
    and releases orbax's resources."""
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

  # -- restore -------------------------------------------------------------------------------

  def steps(self) -> list[int]:
    """The complete checkpoints rank 0 sees, oldest first (collective)."""
    steps = self._store.steps() if self._store is not None else None
    return self.comm.mpi_comm.bcast(steps, root=0) if self.comm.size > 1 else steps

  def restore(self, template: Any) -> tuple[int, Any, dict] | None:
    """The newest intact checkpoint, as ``(step, state, meta)`` on every rank, or None.

    Collective. Rank 0 tries the checkpoints from the newest down; one that fails to read
    or to verify is reported on stderr and skipped. The state is broadcast from rank 0,
    so every rank resumes from the same step.

    Args:
      template: a pytree like the saved state (e.g. the freshly initialised state): its
        structure, shapes and dtypes are checked (a Python scalar leaf, like a fresh
        ``TrainState.step``, or a 0-d numpy one, takes the dtype that was saved), and its
        leaves say how to return each value (jax array on the same sharding, numpy, PRNG
        key, scalar). A `shard_optimizer` state in it (this communicator's, e.g. a fresh
        ``init``) receives this rank's share of the whole state saved there, however many
        ranks saved it.

    Returns:
      None when the directory holds no checkpoint; otherwise ``(step, state, meta)``.

    Raises (on every rank):
      CorruptCheckpointError: checkpoints exist but none reads back intact.
      CheckpointTemplateError: the newest readable checkpoint holds another tree (structure,
        shapes or dtypes) than `template` on some rank; nothing falls back past it.
      ValueError: the checkpoint was saved with other ``settings``.
    """
    wrong = (sharded.check(self.comm, template, "Checkpointer.restore")
             or own.check(self.comm, template, "Checkpointer.restore"))
    if wrong:
      raise CheckpointTemplateError(
          f"{wrong} Nothing was loaded. Build the template's optimizer state with"
          " shard_optimizer(tx, comm).init(params) for this job's communicator.")
    original = template
    template = own.whole_template(self.comm, template)  # every rank's PerRankState parts
    shards, template = template, sharded.whole_template(template)  # as written on disk
    outcome: Any = None
    state = None
    if self._store is not None:
      outcome, state = self._store.newest(template)
    outcome = self.comm.mpi_comm.bcast(outcome, root=0) if self.comm.size > 1 else outcome
    if isinstance(outcome, str):
      raise CorruptCheckpointError(outcome)
    if outcome is None:
      return None
    self._check_template(outcome, template)
    changed = {k: (outcome.get("settings", {}).get(k), v) for k, v in self.settings.items()
               if outcome.get("settings", {}).get(k) != v}
    if changed:
      raise ValueError(
          f"Checkpointer.restore: checkpoint {outcome['step']} in {self.directory} was saved"
          f" with other settings (saved, now): {changed}. Resume with the saved settings, or"
          " start a new run in another directory.")
    if state is None:  # not rank 0: receive into buffers shaped like the saved leaves
      state = target(template, outcome["signature"])
    state = broadcast(state, self.comm, root=0)
    state = jax.tree.map(like, state, template)
    state = own.pick(self.comm, sharded.reshard(state, shards, like), original, like)
    return outcome["step"], state, outcome["meta"]

  def resume(self, template: Any, *, requested: bool) -> tuple[int, Any, dict] | None:
    """What a training script does at start: `restore` when resuming was `requested`, and
    refuse to start afresh over existing checkpoints otherwise (same error on every rank).

    Returns:
      `restore`'s ``(step, state, meta)``, or None to start from `template`.

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
    """`CheckpointTemplateError` on every rank unless every rank's `template` matches the
    tree `record` describes."""
    try:
      mine = template_difference(record, template)
    except Exception as error:  # noqa: BLE001 (every rank must reach the allgather)
      mine = f"{type(error).__name__}: {error}"
    every = self.comm.mpi_comm.allgather(mine) if self.comm.size > 1 else [mine]
    wrong = [rank for rank, difference in enumerate(every) if difference]
    if wrong:
      raise CheckpointTemplateError(
          f"Checkpointer.restore: checkpoint {record['step']} in {self.directory} reads"
          " back (it is not damaged), but it holds a different tree than the template it"
          f" is restored into (on ranks {wrong} of {self.comm.size}): {every[wrong[0]]}."
          " Nothing was loaded and the checkpoint is untouched. Pass a template built like"
          " the saved state (the model, optimizer and state layout of the run that saved"
          " it), or start the new run in another directory.")
