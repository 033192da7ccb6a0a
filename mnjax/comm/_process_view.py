"""Under the MPI kinds JAX sees one process: `watch` makes ``jax.process_index``/``process_count``
warn once per calling line on ranks but 0, never for mnjax's calls (docs/design/failures.md)."""

from __future__ import annotations

import functools
import sys
import warnings

__all__ = ["watch", "watch_group"]

_NAMES = ("process_index", "process_count")
_JOB: dict = {}  # the first watched job: rank, size, kind
_QUIET = ["mnjax"]  # the packages whose calls never warn (and orbax on a group's rank 0)


def watch(comm) -> None:
  """From now on, warn where this rank's code reads JAX's (wrong) process index or count.

  Example:
    >>> watch(comm)   # one process: nothing is replaced
    >>> jax.process_index()
    0
  """
  import jax  # noqa: PLC0415 (started by the caller)

  if comm.kind == "xla" or comm.size == 1 or comm.rank == 0 or _JOB:
    return
  if jax.process_count() == comm.size:
    return
  _JOB.update(rank=comm.rank, size=comm.size, kind=comm.kind)
  for name in _NAMES:
    setattr(jax, name, _watched(getattr(jax, name), f"jax.{name}"))


def watch_group(group) -> None:
  """On a `Communicator.split` group's rank 0 (which runs orbax), orbax's calls stay quiet.

  Example:
    >>> watch_group(comm)   # rank 0 of its group: orbax's calls on this process stay quiet
  """
  if group.rank == 0 and "orbax" not in _QUIET:
    _QUIET.append("orbax")


def _watched(original, name: str):
  @functools.wraps(original)
  def wrapper(*args, **kwargs):
    value = original(*args, **kwargs)
    if not _called_by_mnjax(sys._getframe(1)):
      warnings.warn(_message(name, value), UserWarning, stacklevel=2)
    return value

  return wrapper


def _called_by_mnjax(frame) -> bool:
  while frame is not None:
    module = frame.f_globals.get("__name__", "")
    if any(module == quiet or module.startswith(quiet + ".") for quiet in _QUIET):
      return True
    frame = frame.f_back
  return False


def _message(name: str, value: int) -> str:
  rank, size, kind = _JOB["rank"], _JOB["size"], _JOB["kind"]
  return (
      f"mnjax: jax.process_index() and jax.process_count() do not describe this job:"
      f" {name}() returned {value} on rank {rank} of this {size}-process job (kind {kind!r}"
      " runs over MPI and does not start jax.distributed, so JAX sees one process on every"
      " rank). Code that picks its data shard or the process that writes by them (flax's"
      " examples, tfds.split_for_jax_process, flax.training.checkpoints) reads shard 0 and"
      " writes on every rank. Use comm.rank for jax.process_index(), comm.size for"
      " jax.process_count() and comm.is_root for jax.process_index() == 0 (README, \"Porting"
      " a pmap script\"). If this call is deliberate, silence it with"
      " warnings.filterwarnings('ignore', message='mnjax: jax.process_index').")
