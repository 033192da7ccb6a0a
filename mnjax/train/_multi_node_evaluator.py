"""`generic_multi_node_evaluator`: metrics that do not add up, over every rank's shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from mpi4py.util import pkl5

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host import _objects as objects
from mnjax.comm._host._agreement import check_same_tree

__all__ = ["generic_multi_node_evaluator"]


def generic_multi_node_evaluator(
    comm: Communicator,
    calc_local: Callable[..., Any],
    aggregate: Callable[[list[Any]], Any] | None = None,
    *,
    root: int | None = 0,
) -> Callable[[Iterable[Any]], Any]:
  """An evaluator: ``evaluator(batches)`` runs `calc_local` on each of this rank's batches
  and `aggregate` on all ranks' results (ChainerMN's ``GenericMultiNodeEvaluator``).

  A tuple batch is passed as ``calc_local(*batch)``, a dict as ``calc_local(**batch)``; results
  are ordered by round, then rank. `calc_local` must not communicate. Calling the evaluator is
  collective; an error in `calc_local` on one rank raises `RuntimeError` on every rank.

  Args:
    calc_local: a batch's result (e.g. a jitted forward pass returning predictions).
    aggregate: ``aggregate(results) -> value``; default: the list of results itself.
    root: the rank whose evaluator returns `aggregate`'s value (the others: None), or None:
      every rank.

  Example:
    >>> x = np.arange(10.0)
    >>> shard = mnjax.scatter_dataset(x, comm, force_equal_length=False)  # uneven, exact
    >>> median = mnjax.train.generic_multi_node_evaluator(
    ...     comm, lambda xs: xs * 2, lambda results: float(np.median(np.concatenate(results))),
    ...     root=None)
    >>> median([shard[i:i + 3] for i in range(0, len(shard), 3)])  # not a mean of medians
    9.0
  """
  caller = "generic_multi_node_evaluator"
  check_communicator(comm, caller)
  if not callable(calc_local) or not (aggregate is None or callable(aggregate)):
    name, fn = ("calc_local", calc_local) if not callable(calc_local) else ("aggregate",
                                                                             aggregate)
    raise TypeError(f"{caller}: {name} must be callable, got {type(fn).__name__}.")
  check_same_tree({}, comm, caller, arguments={"root": root})
  valid = root is None or (isinstance(root, (int, np.integer)) and not isinstance(root, bool)
                           and 0 <= root < comm.size)
  if not valid:  # the same root everywhere (compared above): every rank raises
    raise ValueError(f"{caller}: root must be a rank in [0, {comm.size}) or None (every rank"
                     f" aggregates), got {root!r}.")
  wire = pkl5.Intracomm(comm.mpi_comm)

  def evaluator(batches: Iterable[Any]) -> Any:
    results, problem = [], None
    try:
      for batch in batches:
        if isinstance(batch, tuple):
          result = calc_local(*batch)
        elif isinstance(batch, dict):
          result = calc_local(**batch)
        else:
          result = calc_local(batch)
        results.append(jax.device_get(result))
    except Exception as e:  # noqa: BLE001  (every rank raises it, below)
      problem = f"{type(e).__name__}: {e}"
    problems = objects.allgather_obj(problem, comm, operation=caller)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
      listed = "; ".join(f"rank {r}: {p}" for r, p in failed)
      raise RuntimeError(f"{caller}: calc_local failed on {len(failed)} of {comm.size}"
                         f" rank(s) ({listed}); nothing was aggregated.")
    if comm.size == 1:
      everyone = [results]
    elif root is None:
      everyone = wire.allgather(results)
    else:
      everyone = wire.gather(results, root=int(root))
      if comm.rank != root:
        return None
    ordered = [mine[k] for k in range(max(map(len, everyone), default=0))
               for mine in everyone if k < len(mine)]
    return ordered if aggregate is None else aggregate(ordered)

  return evaluator
