"""Run a per-device step over this process's local devices (docs/design/multi_device.md)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._instep import _sequence as sequence
from mnjax.guard import _program as program
from mnjax.train import _step_checks as checks

__all__ = ["data_parallel", "replica_index"]

def data_parallel(
    fn: Callable[..., Any],
    comm: Communicator,
    *,
    batch_argnums: Sequence[int] = (1,),
    per_device_outputs: Sequence[int] = (),
    check_program: bool = True,
) -> Callable[..., Any]:
  """A jitted version of the per-device step `fn` that runs on every local device.

  Before the first run the ranks compare the step's collectives and program (a difference is a
  `ValueError` on every rank); a collective over ``comm.axis_name`` needs `mnjax.process_local`.

  Args:
    fn: ``fn(*args)``, written for one device and one device's share of the batch.
    comm: the `Communicator`; for ``flat`` the result is just ``jax.jit(fn)``.
    batch_argnums: positions of the arguments (this process's batch) split evenly along
      axis 0 across the local devices; the others are replicated.
    per_device_outputs: positions in `fn`'s output tuple that differ per device; they come
      back stacked, one row per local device, as ``jax.pmap`` returns them.
    check_program: False skips the program comparison (the collectives are still compared).

  Example:
    >>> comm = mnjax.create_communicator("hierarchical")   # this process's devices
    >>> def step_fn(total, x):                              # one device's share of x
    ...   return total + mnjax.comm.allreduce_tree(x.sum(), comm, mean=False), x.sum()
    >>> step = mnjax.data_parallel(step_fn, comm, batch_argnums=(1,), per_device_outputs=(1,))
    >>> x = jnp.arange(4.0 * comm.local_device_count)     # this process's batch
    >>> total, per_device = step(jnp.zeros(()), x)
    >>> float(total) == comm.size * float(x.sum()), per_device.shape == (comm.local_device_count,)
    (True, True)
  """
  check_communicator(comm, "data_parallel")
  if not isinstance(check_program, bool):
    raise TypeError(f"data_parallel: check_program must be a bool, got {check_program!r}.")
  batch_argnums = _positions(batch_argnums, "batch_argnums", "step argument")
  per_device_outputs = _positions(per_device_outputs, "per_device_outputs", "output of fn")

  agreed: set = set()  # the collective sequences this step's ranks have agreed on
  # xla, several local devices: replicated outputs come from the first device only.
  first_device = (sequence.state_from_first_device
                  if comm.kind == "xla" and comm.local_device_count > 1 else contextlib.nullcontext)

  def per_device(*args):  # fn, with per-device outputs given a leading axis: one row each
    out = fn(*args)
    if not per_device_outputs:
      return out
    out = list(_output_tuple(out, per_device_outputs))
    for i in per_device_outputs:
      out[i] = jax.tree_util.tree_map_with_path(functools.partial(_row, i), out[i])
    return tuple(out)

  def stacked(*args):
    _check_batch_positions(batch_argnums, len(args))  # while tracing: once per compilation
    # Traced once into a jaxpr (compared across ranks), then replayed into the step's trace.
    with checks.recording() as collectives, first_device():  # SyncBatchNorm's, in order
      closed, shapes = checks.trace(per_device, args, comm)
    checks.check_step(closed, args, shapes, comm, collectives, agreed=agreed,
                      batch_argnums=batch_argnums, per_device_outputs=per_device_outputs,
                      check_program=check_program)
    run = jaxpr_as_fun(closed)
    if not comm.multi_device and checks.uses_axis(closed, comm):  # process_local, one device
      run = jax.shard_map(run, mesh=comm.mesh, in_specs=P(), out_specs=P(), check_vma=False)
    flat = run(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shapes), flat)

  if not comm.multi_device:
    return jax.jit(stacked)
  n = comm.local_device_count

  @functools.cache
  def compiled(nargs: int, nout: int | None):
    in_specs = tuple(P(comm.axis_name) if i in batch_argnums else P() for i in range(nargs))
    out_specs = (P() if nout is None else
                 tuple(P(comm.axis_name) if i in per_device_outputs else P() for i in range(nout)))
    mapped = jax.shard_map(stacked, mesh=comm.mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)
    return jax.jit(mapped)

  output_lengths: dict[int, int] = {}
  shardings = _XlaShardings.of(comm) if comm.kind == "xla" else None

  def step(*args):
    _check_batch_positions(batch_argnums, len(args))
    for i in batch_argnums:
      for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
        rows = leaf.shape[0] if getattr(leaf, "ndim", 0) else None
        if rows is None or rows % n:
          raise ValueError(
              f"data_parallel: argument {i} leaf {jax.tree_util.keystr(path) or '<root>'}"
              f" has {rows} examples on this process, which do not split over its {n}"
              f" local devices. Use a per-process batch that is a multiple of {n} (a global"
              f" batch that is a multiple of {comm.num_replicas})."
          )
    nout = None
    if per_device_outputs:  # the output tuple's length, from one abstract evaluation
      if len(args) not in output_lengths:
        shapes = _global_shapes(args, batch_argnums, comm)
        output_lengths[len(args)] = len(jax.eval_shape(compiled(len(args), None), *shapes))
      nout = output_lengths[len(args)]
    run = compiled(len(args), nout)
    if comm.kind == "xla":
      return _local(run(*_global(args, batch_argnums, shardings)), per_device_outputs)
    return run(*args)

  return step


def replica_index(comm: Communicator) -> jax.Array:
  """This replica's index among ``comm.num_replicas`` (int32), inside a `data_parallel` step.

  ``comm.rank * comm.local_device_count`` plus the local device's (``xla``: its place in the
  job's mesh), the order the batch is dealt in. Fold it into per-replica keys (dropout):
  under the MPI kinds ``lax.axis_index`` repeats on every process.

  Example:
    >>> index = mnjax.data_parallel(lambda: (mnjax.train.replica_index(comm),), comm,
    ...                             batch_argnums=(), per_device_outputs=(0,))()[0]
    >>> index.tolist() == [comm.rank * comm.local_device_count + i
    ...                    for i in range(comm.local_device_count)]
    True
  """
  check_communicator(comm, "replica_index")
  if comm.kind == "xla":
    return jax.lax.axis_index(comm.axis_name)
  with program.rank_dependent():  # a constant per rank, made an operation of the program
    first = jax.lax.optimization_barrier(np.int32(comm.rank * comm.local_device_count))
  return first + jax.lax.axis_index(comm.axis_name) if comm.multi_device else first


def _positions(value: Any, name: str, what: str) -> tuple[int, ...]:
  """`value` as a tuple of positions (an int counts as one), or a clear error."""
  def is_position(p):
    return isinstance(p, (int, np.integer)) and not isinstance(p, bool) and p >= 0

  try:
    positions = (value,) if is_position(value) else tuple(value)
  except TypeError:
    positions = (None,)
  if not all(is_position(p) for p in positions):
    raise ValueError(
        f"data_parallel: {name} must be positions (ints >= 0, each the index of a {what}),"
        f" got {value!r}. Count from the start: for the last of three, pass 2.")
  return tuple(int(p) for p in positions)


def _check_batch_positions(batch_argnums: tuple[int, ...], nargs: int) -> None:
  """Raises `ValueError` if `batch_argnums` names a position past the step's arguments."""
  beyond = [i for i in batch_argnums if i >= nargs]
  if beyond:
    raise ValueError(
        f"data_parallel: batch_argnums={batch_argnums} names position(s) {beyond}, but the"
        f" step was called with {nargs} argument(s), so nothing would be split there."
        " Name the positions of the batch arguments (e.g. batch_argnums=(1, 2) for"
        " step(state, images, labels)).")


def _output_tuple(out: Any, per_device_outputs: tuple) -> tuple:
  """`fn`'s output, checked to be a tuple long enough for `per_device_outputs`."""
  if not isinstance(out, (tuple, list)):
    raise TypeError(
        f"data_parallel: per_device_outputs={per_device_outputs} names positions in fn's"
        f" output tuple, but fn returned a {type(out).__name__}. Return a tuple (e.g."
        " `return state, metrics` with per_device_outputs=(1,)), or drop per_device_outputs.")
  if max(per_device_outputs) >= len(out):
    raise ValueError(
        f"data_parallel: per_device_outputs={per_device_outputs} names position"
        f" {max(per_device_outputs)}, but fn returned {len(out)} outputs (positions 0 to"
        f" {len(out) - 1}).")
  return tuple(out)


def _row(index: int, path: tuple, leaf: Any) -> jax.Array:
  """One device's row of a per-device output leaf (a Python number too, as ``pmap``)."""
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
    return jax.numpy.asarray(leaf)[None]
  raise TypeError(
      f"data_parallel: per-device output {index} (per_device_outputs) has a leaf"
      f" {jax.tree_util.keystr(path) or '<root>'} of type {type(leaf).__name__} ({leaf!r});"
      " each of its leaves must be an array or a Python number (a jitted step returns"
      " arrays only). Return it as a jnp array (jnp.asarray(...)), or keep it out of the"
      " step's outputs.")


class _XlaShardings(NamedTuple):
  """``xla``: where global arguments live (built once per `data_parallel`)."""

  split: NamedSharding  # the batch, over every device of the job
  replicated: NamedSharding  # everything else, on every device of the job
  local: NamedSharding  # replicated over this process's devices only

  @classmethod
  def of(cls, comm: Communicator) -> _XlaShardings:
    mesh = comm.mesh
    local_mesh = jax.sharding.Mesh(np.array(comm.devices), ("local",))
    return cls(NamedSharding(mesh, P(comm.axis_name)), NamedSharding(mesh, P()),
               NamedSharding(local_mesh, P()))


def _global(args: tuple, batch_argnums: tuple, shardings: _XlaShardings) -> list:
  """``xla``: this process's arguments as global arrays (batch rows process-major)."""

  def replicate(leaf):
    leaf = jax.device_put(leaf, shardings.local)  # one copy per local device
    shards = [shard.data for shard in leaf.addressable_shards]
    return jax.make_array_from_single_device_arrays(np.shape(leaf), shardings.replicated, shards)

  def split(leaf):
    return jax.make_array_from_process_local_data(shardings.split, np.asarray(leaf))

  return [jax.tree.map(split if i in batch_argnums else replicate, arg)
          for i, arg in enumerate(args)]


def _global_shapes(args: tuple, batch_argnums: tuple, comm: Communicator) -> list:
  """Abstract arguments as the mapped function sees them (``xla``: the whole global batch)."""
  scale = comm.size if comm.kind == "xla" else 1

  def batch(x):
    return jax.ShapeDtypeStruct((np.shape(x)[0] * scale, *np.shape(x)[1:]), x.dtype)

  return [jax.tree.map(batch, a) if i in batch_argnums else a for i, a in enumerate(args)]


def _local(out: Any, per_device_outputs: tuple) -> Any:
  """``xla``: global outputs back to this process's arrays, as the other kinds return them."""

  def rows(a):
    shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start)
    return jax.numpy.concatenate([jax.device_put(s.data, shards[0].device) for s in shards])

  if not per_device_outputs:
    return jax.tree.map(lambda a: a.addressable_data(0), out)
  return tuple(
      jax.tree.map(rows if i in per_device_outputs else (lambda a: a.addressable_data(0)), o)
      for i, o in enumerate(out)
  )
