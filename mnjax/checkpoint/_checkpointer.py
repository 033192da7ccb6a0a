"""Checkpoints that can always be resumed: atomic, verified, the same step on every rank.

`Checkpointer` saves any pytree of training state — parameters, optimizer state (mnjax's
transformation states included), RNG keys, epoch and data position — with
orbax-checkpoint, and restores it exactly:

- **One writer.** Under plain ``mpirun`` every process is its own single-process JAX, so
  orbax cannot coordinate the ranks; replicas are identical anyway, so rank 0 writes and
  the others only check that they are saving the same step.
- **Atomic.** Orbax writes into a temporary directory and renames it when complete; a save
  killed half-way is never listed, never loaded. The last ``keep`` checkpoints are kept.
- **Verified.** Each checkpoint carries a BLAKE2b digest per leaf (`mnjax.comm._digest`).
  A checkpoint that does not read back, or whose bytes no longer match (truncated,
  flipped), is reported and skipped in favour of the previous one; if none is readable,
  restore fails saying so. It is never loaded silently.
- **Same step everywhere.** Rank 0 chooses the step, reads it and broadcasts the state, so
  ranks with a stale or private view of the directory cannot resume from different steps.

Saving is asynchronous by default: rank 0 copies the state to host memory and orbax writes
it in the background while training goes on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._digest import compare_digests, tree_digests
from mnjax.comm._host import broadcast, tree_signature

__all__ = ["Checkpointer", "CorruptCheckpointError"]


class CorruptCheckpointError(RuntimeError):
  """No checkpoint in the directory could be read back intact."""


def _is_key(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _to_host(leaf: Any) -> np.ndarray:
  """A private host copy (the device buffer may be donated to the next step meanwhile)."""
  if _is_key(leaf):
    leaf = jax.random.key_data(leaf)
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    leaf = leaf.addressable_shards[0].data  # replicated across processes
  return np.array(leaf, copy=True)


def _like(value: np.ndarray, template: Any) -> Any:
  """`value` as the kind of leaf `template` is: numpy, key, a jax array placed like the
  template (committed to its sharding, or uncommitted when the template is)."""
  if _is_key(template):
    return jax.random.wrap_key_data(value, impl=jax.random.key_impl(template))
  if isinstance(template, jax.Array):
    if not template.committed:  # free to follow the step's sharding, like a fresh array
      return jnp.asarray(value)
    if template.is_fully_addressable:
      return jax.device_put(value, template.sharding)
    return jax.make_array_from_callback(value.shape, template.sharding, lambda i: value[i])
  if isinstance(template, np.ndarray) or np.ndim(template):
    return value
  return value.item() if isinstance(template, (int, float, bool)) else value


def _digests(tree: Any) -> dict[str, str]:
  """``{leaf path: 128-bit digest}`` of a host tree, as saved in each checkpoint's record."""
  return {path: digest for path, (digest,) in tree_digests(tree, digest_size=16).items()}


def _damaged(saved: dict[str, str], state: Any) -> list[str]:
  """The leaves of `state` (read back) whose digest is not the one `saved` with it."""
  # Older records name the one leaf of a state that is a bare array '' rather than '<root>'.
  saved = {path or "<root>": [digest] for path, digest in saved.items()}
  return list(compare_digests(saved, tree_digests(state, digest_size=16)))


class Checkpointer:
  """Saves and restores training state in `directory` (collective: every rank calls it).

  Args:
    directory: where checkpoints live (one subdirectory per step). Rank 0 must be able to
      write it; the other ranks never touch it.
    comm: the `Communicator`.
    keep: how many of the most recent checkpoints to keep (>= 1).
    async_save: write in a background thread (rank 0); `close` waits for it.
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
    self._manager = None
    if comm.is_root:
      import orbax.checkpoint as ocp  # noqa: PLC0415 (heavy; rank 0 only)

      # Under jax.distributed (kind 'xla') orbax would wait for every process: rank 0 alone.
      multiprocessing = (ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
                         if jax.process_count() > 1 else ocp.options.MultiprocessingOptions())
      os.makedirs(self.directory, exist_ok=True)
      self._ocp = ocp
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(
              max_to_keep=keep, create=False, enable_async_checkpointing=async_save,
              cleanup_tmp_directories=True, multiprocessing_options=multiprocessing))

  # -- save ----------------------------------------------------------------------------------

  def save(self, step: int, state: Any, *, meta: dict | None = None) -> None:
    """Saves `state` as checkpoint `step` (collective; rank 0 writes). An existing
    checkpoint of the same step (say, one a restore skipped as damaged) is replaced.

    Args:
      step: the global step count (equal on every rank, or `ValueError` on every rank).
      state: the pytree to save; jax arrays, numpy arrays, Python scalars and PRNG keys.
      meta: JSON-serialisable extras restored with it (epoch, data position, config).
    """
    step = int(step)
    steps = self.comm.mpi_comm.allgather(step) if self.comm.size > 1 else [step]
    if len(set(steps)) > 1:
      raise ValueError(
          f"Checkpointer.save: the ranks are saving different steps {steps}; every rank"
          " must call save at the same step (replicas are identical only at equal steps).")
    if self._manager is None:
      return
    host = jax.tree.map(_to_host, state)
    record = {"step": step, "meta": meta or {}, "settings": self.settings,
              "digests": _digests(host),
              "signature": _signature(host)}
    args = self._ocp.args
    self._manager.wait_until_finished()
    if step in self._manager.all_steps():  # an earlier attempt's (e.g. one skipped as damaged)
      self._manager.delete(step)
    # force: orbax would otherwise skip, without a word, any step not newer than its latest.
    self._manager.save(step, force=True, args=args.Composite(
        state=args.StandardSave(host), record=args.JsonSave(record)))

  def wait(self) -> None:
    """Blocks until rank 0's background write, if any, is on disk."""
    if self._manager is not None:
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last write and releases orbax's resources."""
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._manager.close()
      self._manager = None

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- restore -------------------------------------------------------------------------------

  def steps(self) -> list[int]:
    """The complete checkpoints rank 0 sees, oldest first (collective)."""
    steps = sorted(self._manager.all_steps()) if self._manager is not None else None
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
        key, scalar).

    Returns:
      None when the directory holds no checkpoint; otherwise ``(step, state, meta)``.

    Raises:
      CorruptCheckpointError: checkpoints exist but none reads back intact.
      ValueError: the checkpoint was saved with other ``settings``.
    """
    outcome: Any = None
    state = None
    if self._manager is not None:
      outcome, state = self._restore_newest(template)
    outcome = self.comm.mpi_comm.bcast(outcome, root=0) if self.comm.size > 1 else outcome
    if isinstance(outcome, str):
      raise CorruptCheckpointError(outcome)
    if outcome is None:
      return None
    changed = {k: (outcome.get("settings", {}).get(k), v) for k, v in self.settings.items()
               if outcome.get("settings", {}).get(k) != v}
    if changed:
      raise ValueError(
          f"Checkpointer.restore: checkpoint {outcome['step']} in {self.directory} was saved"
          f" with other settings (saved, now): {changed}. Resume with the saved settings, or"
          " start a new run in another directory.")
    if state is None:  # not rank 0: receive into buffers shaped like the saved leaves
      state = _target(template, outcome["signature"])
    state = broadcast(state, self.comm, root=0)
    state = jax.tree.map(_like, state, template)
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

  def _restore_newest(self, template: Any) -> tuple[Any, Any]:
    """Rank 0: (record, state) of the newest intact step; (None, None) with no steps, or
    (message, None) when every step is damaged."""
    steps = sorted(self._manager.all_steps(), reverse=True)
    problems = []
    args = self._ocp.args
    for step in steps:
      try:
        record = self._manager.restore(step, args=args.Composite(
            record=args.JsonRestore()))["record"]
        if record.get("step") != step:
          raise ValueError(f"its record names step {record.get('step')}")
        _check_signature(record["signature"], template)
        target = _target(template, record["signature"])
        state = self._manager.restore(step, args=args.Composite(
            state=args.StandardRestore(target)))["state"]
        state = jax.tree.map(np.asarray, state)
        bad = _damaged(record["digests"], state)
        if bad:
          raise ValueError(f"its bytes do not match the digests saved with it (leaves {bad[:5]})")
      except Exception as error:  # noqa: BLE001 (any read failure means: do not load it)
        problems.append(f"step {step}: {type(error).__name__}: {str(error)[:300]}")
        sys.stderr.write(f"mnjax.Checkpointer: skipping checkpoint {self.directory}/{step}:"
                         f" {problems[-1]}\n")
        continue
      return record, state
    if not steps:
      return None, None
    return (f"Checkpointer.restore: none of the {len(steps)} checkpoints in {self.directory}"
            f" reads back intact: {'; '.join(problems)}. Nothing was loaded. Restore a copy"
            " of the directory, or move it away to start from scratch."), None


def _signature(host: Any) -> list[list[str]]:
  return [list(map(str, s)) for s in tree_signature(host)]


def _check_signature(saved: list, template: Any) -> None:
  """Same leaves and shapes as `template`; same dtypes, except for host scalars (a Python
  or 0-d numpy step counter takes the dtype the jitted step gave it)."""
  leaves = jax.tree.leaves(template)
  expected = _signature(jax.tree.map(_to_host, template))
  if [s[:2] for s in saved] != [e[:2] for e in expected] or any(
      s[2] != e[2] for s, e, leaf in zip(saved, expected, leaves)
      if isinstance(leaf, jax.Array) or np.ndim(leaf)):
    diff = [f"{e[0]} saved as {s[2]}{s[1]}, expected {e[2]}{e[1]}"
            for s, e in zip(saved, expected) if s != e][:3]
    raise ValueError(
        f"it holds a different tree than the state it is restored into ({len(saved)} vs"
        f" {len(expected)} leaves; {'; '.join(diff)})")


def _target(template: Any, saved: list) -> Any:
  """Host buffers with the template's structure and the saved shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(template)
  if len(leaves) != len(saved):
    raise ValueError(f"it holds {len(saved)} leaves, the state {len(leaves)}")
  shapes = [np.shape(jax.random.key_data(x) if _is_key(x) else x) for x in leaves]
  return jax.tree.unflatten(
      treedef, [np.zeros(shape, np.dtype(dtype)) for shape, (_, _, dtype) in zip(shapes, saved)])
