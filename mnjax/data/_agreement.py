"""`check_same_plan`: the ranks must agree on what decides which examples each of them reads."""

from __future__ import annotations

from typing import Any

import numpy as np

from mnjax.comm._communicator import Communicator
from mnjax.comm._host._agreement import gather_if_different

__all__ = ["check_same_plan"]

#: Seconds a rank waits for the others to reach the same check (their start-up may differ).
TIMEOUT = 600.0


def _canonical(value: Any) -> Any:
  """`value` as a plain Python value with a deterministic ``repr`` (np.int64(3) is 3)."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value)
  if value is None or isinstance(value, str):
    return value
  return f"<{type(value).__name__}>"  # arbitrary objects: their repr may hold an address


def _ranks(ranks: list[int]) -> str:
  if len(ranks) == 1:
    return f"rank {ranks[0]}"
  return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def describe_plans(everyone: list[tuple[tuple[str, Any], ...]]) -> list[str]:
  """``"seed 1 on rank 0, 2 on rank 1"`` for every value that differs between ranks.

  Example:
    >>> describe_plans([(("seed", 1), ("epoch", 0)), (("seed", 2), ("epoch", 0))])
    ['seed 1 on rank 0, 2 on rank 1']
  """
  plans = [dict(plan) for plan in everyone]
  labels = list(dict.fromkeys(label for plan in everyone for label, _ in plan))
  out = []
  for label in labels:
    column = [plan.get(label, "not used") for plan in plans]
    if len(set(map(repr, column))) == 1:
      continue
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(column):
      groups.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
    out.append(f"{label} " + ", ".join(f"{value} on {_ranks(ranks)}"
                                       for value, ranks in groups.items()))
  return out


def check_same_plan(comm: Communicator, caller: str, values: dict[str, Any],
                    fix: str = "") -> None:
  """Raises the same `ValueError` on every rank unless every rank passed equal `values`.

  Collective (host level; nothing at size 1). `fix` is appended to the message.

  Example:
    >>> check_same_plan(comm, "epoch_batches", {"dataset size": 100, "seed": 0, "epoch": 3})
  """
  if comm.size == 1:
    return
  plan = tuple((label, _canonical(value)) for label, value in values.items())
  everyone = gather_if_different(
      comm, f"{caller}'s data order", plan, what=f"{caller}'s check of the data order",
      timeout=TIMEOUT,
      timeout_message=(
          f"{caller}: rank {comm.rank} waited {TIMEOUT:.0f} s for the other ranks to compare"
          f" {', '.join(values)}, and not all of them came. Every rank must call {caller}"
          " the same number of times (e.g. once per epoch, on every rank)."))
  if everyone is None:
    return
  sizes = {dict(p).get("dataset size") for p in everyone}
  data = (" Every rank must hold the same dataset, in full (the same files, split and"
          " filter): mnjax shards by index, and sends data only from a scatter_dataset"
          " root." if len(sizes) > 1 else "")
  details = describe_plans(everyone) or [  # equal values, different hashes: a broken comm
      f"the values hash differently although they read {everyone[0]!r} (is comm.size"
      f" {comm.size} the size of comm.mpi_comm?)"]
  raise ValueError(
      f"{caller}: the ranks disagree on what decides which examples each of them reads:"
      f" {'; '.join(details)}. Each rank cuts its share from these values"
      " alone, so some examples would be read twice and others never in an epoch (or the"
      " ranks would run different numbers of steps and wait on each other forever)."
      f"{data} Pass the same values on every rank (from the shared config, never from"
      f" comm.rank).{(' ' + fix) if fix else ''} Nothing was read.")
