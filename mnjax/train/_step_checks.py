"""Every check `mnjax.data_parallel` makes of a traced step before it first runs (`check_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mnjax.comm._communicator import Communicator
from mnjax.guard import _preflight as preflight
from mnjax.guard import _program as program
from mnjax.optim._accumulation import AccumulationState
from mnjax.optim._double_buffering import PendingGradient
from mnjax.train import _replicated as replicated

__all__ = ["arg_paths", "check_local_collectives", "check_replicated_outputs", "check_step",
           "process_local", "recording", "trace"]

#: The `jax.named_scope` that `process_local` opens (read by `mnjax.guard._program`).
PROCESS_LOCAL_SCOPE = "mnjax_process_local"


def process_local():
  """A scope for collectives over ``comm.axis_name`` meant for this process's devices only.

  Except under ``xla`` such a collective (``jax.lax.pmean``, a flax ``BatchNorm``) spans this
  process's devices only, unlike ``pmap``'s; `data_parallel` refuses it outside this scope.

  Example:
    >>> comm = mnjax.create_communicator("hierarchical")
    >>> def step(x):
    ...   with mnjax.process_local():
    ...     return jax.lax.pmean(x, comm.axis_name)   # this process's devices, on purpose
    >>> x = jnp.arange(float(comm.local_device_count))
    >>> float(mnjax.data_parallel(step, comm, batch_argnums=(0,))(x)[0]) == float(x.mean())
    True
  """
  return jax.named_scope(PROCESS_LOCAL_SCOPE)


def trace(fn: Callable[..., Any], args: tuple, comm: Communicator) -> tuple:
  """``jax.make_jaxpr(fn, return_shape=True)(*args)``; under ``flat`` with ``comm.axis_name``
  bound to this process's one device (`check_local_collectives` refuses what uses it outside
  `process_local`)."""
  axis_env = [] if comm.multi_device else [(comm.axis_name, 1)]
  return jax.make_jaxpr(fn, axis_env=axis_env, return_shape=True)(*args)


def uses_axis(closed: Any, comm: Communicator) -> bool:
  """Whether the traced step names ``comm.axis_name`` (under ``flat``: only inside
  `process_local`, once `check_local_collectives` passed)."""
  return bool(program.user_collectives(closed, comm.axis_name, allowed_scope="\0"))


def check_local_collectives(closed: Any, comm: Communicator) -> None:
  """Refuses user collectives over ``comm.axis_name`` that would span this process only."""
  if comm.kind == "xla":
    return  # the axis spans every device of the job
  found = program.user_collectives(closed, comm.axis_name, allowed_scope=PROCESS_LOCAL_SCOPE)
  if found and not comm.multi_device:
    raise ValueError(
        f"data_parallel: the step calls {len(found)} collective(s) over {comm.axis_name!r}"
        f" ({'; '.join(found[:3])}{'; ...' if len(found) > 3 else ''}; e.g."
        f" jax.lax.pmean(x, {comm.axis_name!r}) or flax BatchNorm(axis_name=...) left from a"
        " pmap script), but the 'flat' kind runs one device per process, so it would reduce"
        " over this process's one device only. Reduce across every device of every process"
        " with mnjax instead: mnjax.comm.allreduce_tree(x, comm) (mean=True by default)"
        " inside the step, mnjax.allreduce_gradients(comm) for gradients,"
        " mnjax.SyncBatchNorm(comm) for BatchNorm, mnjax.mean_metrics(metrics, comm) for"
        " metrics after the step; drop the collective; or, if this process's device only is"
        " meant, trace it inside `with mnjax.process_local():`.")
  if found:
    raise ValueError(
        f"data_parallel: the step calls {len(found)} collective(s) over {comm.axis_name!r}"
        f" that mnjax did not write ({'; '.join(found[:3])}{'; ...' if len(found) > 3 else ''})."
        f" Under the {comm.kind!r} kind that axis spans this process's"
        f" {comm.local_device_count} device(s) only, not every device of every process as"
        " under a multi-host pmap, so the result would be silently local. Use"
        " mnjax.comm.allreduce_tree(x, comm) (every device of every process),"
        " mnjax.SyncBatchNorm(comm) for BatchNorm, mnjax.mean_metrics after the step; or,"
        " if this process's devices only are meant, trace it inside `with"
        " mnjax.process_local():`.")


#: State that keeps each device's own values by design, not refused as a varying output.
_PER_DEVICE_STATE = (PendingGradient, AccumulationState)


def check_replicated_outputs(closed: Any, args: tuple, shapes: Any, comm: Communicator,
                              batch_argnums: tuple, per_device_outputs: tuple) -> None:
  """Refuses outputs that may differ across the local devices but come back as device 0's."""
  varying_in = [i in batch_argnums
                for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]
  varying = replicated.varying_outputs(closed, varying_in, comm.axis_name)
  positions = (enumerate(shapes) if isinstance(shapes, (tuple, list)) and per_device_outputs
               else [(None, shapes)])
  found, k = [], 0
  for i, out in positions:
    parts = jax.tree.flatten(out, is_leaf=lambda x: isinstance(x, _PER_DEVICE_STATE))[0]
    exempt = [isinstance(p, _PER_DEVICE_STATE) for p in parts for _ in jax.tree.leaves(p)]
    paths = [jax.tree_util.keystr(path) or "<root>"
             for path, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
    for j, path in enumerate(paths):
      if varying[k + j] and not exempt[j] and i not in per_device_outputs:
        found.append(path if i is None else f"output {i} leaf {path}")
    k += len(paths)
  if found:
    raise ValueError(
        f"data_parallel: {len(found)} output leaf(s) may differ across this process's"
        f" {comm.local_device_count} local devices (computed from the batch without a"
        f" reduction over {comm.axis_name!r}) but are not in per_device_outputs:"
        f" {', '.join(found[:4])}{', ...' if len(found) > 4 else ''}. Under {comm.kind!r}"
        " only local device 0's value would come back (e.g. device 0's loss, not the"
        " batch's, or device 0's BatchNorm statistics). Return a tuple and list its position"
        " in per_device_outputs for one row per device (then average them, or use"
        " mnjax.mean_metrics), or reduce it in the step (mnjax.comm.allreduce_tree(x, comm)"
        " for every device of every process; mnjax.SyncBatchNorm for BatchNorm).")


def arg_paths(args: tuple) -> list[str]:
  """A name per leaf of the step's arguments, for the program check's messages."""
  return [f"argument {jax.tree_util.keystr(path)}"
          for path, _ in jax.tree_util.tree_flatten_with_path(list(args))[0]]


def check_step(closed: Any, args: tuple, shapes: Any, comm: Communicator, collectives: list,
               *, agreed: set, batch_argnums: tuple, per_device_outputs: tuple,
               check_program: bool) -> None:
  """Every check of a traced step, in order; `agreed`: sequences the ranks agreed on."""
  check_local_collectives(closed, comm)
  if comm.multi_device:
    check_replicated_outputs(closed, args, shapes, comm, batch_argnums, per_device_outputs)
  fresh = comm.size > 1 and tuple(collectives) not in agreed
  preflight.check_collective_sequence(comm, collectives, caller="data_parallel",
                                      agreed=agreed)
  if fresh and check_program:
    program.check_same_program(
        comm, closed, caller="data_parallel", arg_paths=arg_paths(args),
        fix="or, if it really must differ, build data_parallel with check_program=False")


def recording():
  """The context in which the step is traced: its in-step collectives, recorded in order."""
  return preflight.recording()
