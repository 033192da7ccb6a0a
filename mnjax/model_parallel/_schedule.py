"""The GPipe schedule: each rank's order, whether it deadlocks, and the idle time (bubble)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["Action", "Executed", "ScheduleError", "bubble_fraction", "gpipe", "idle_fraction",
           "programs", "simulate"]


class ScheduleError(ValueError):
  """A schedule that cannot run: it deadlocks, or its sends and receives do not pair."""


class Action(NamedTuple):
  """``kind`` ``"F"`` (forward) or ``"B"`` (backward) of `stage` on micro-batch `micro`."""
  kind: str
  stage: int
  micro: int


class Executed(NamedTuple):
  """An action as `simulate` ran it: on ``rank``, from ``start`` to ``end``."""
  action: Action
  rank: int
  start: float
  end: float


def _check(stages: int, micro_batches: int, caller: str) -> None:
  for name, value in (("stages", stages), ("micro_batches", micro_batches)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{caller}: {name} must be an int >= 1, got {value!r}.")


def bubble_fraction(stages: int, micro_batches: int) -> float:
  """GPipe's idle fraction ``(S - 1) / (M + S - 1)`` for S equal stages and M micro-batches.

  Example:
    >>> bubble_fraction(4, 12)
    0.2
  """
  _check(stages, micro_batches, "bubble_fraction")
  return (stages - 1) / (micro_batches + stages - 1)


def gpipe(stages: int, micro_batches: int) -> list[list[Action | None]]:
  """The ideal GPipe timetable: ``table[slot][stage]``, an action or None (idle).

  F(s, m) runs in slot ``s + m``; the backward mirrors the forward.

  Example:
    >>> [[a and f"{a.kind}{a.micro}" for a in slot] for slot in gpipe(2, 2)]
    [['F0', None], ['F1', 'F0'], [None, 'F1'], [None, 'B1'], ['B1', 'B0'], ['B0', None]]
  """
  _check(stages, micro_batches, "gpipe")
  half = micro_batches + stages - 1
  table: list[list[Action | None]] = [[None] * stages for _ in range(2 * half)]
  for s in range(stages):
    for m in range(micro_batches):
      table[s + m][s] = Action("F", s, m)
      table[half + (stages - 1 - s) + (micro_batches - 1 - m)][s] = Action("B", s, m)
  return table


def idle_fraction(executed: Sequence[Executed] | Sequence[Sequence[Action | None]]) -> float:
  """The fraction of rank-time spent idle, of a `gpipe` table or of `simulate`'s run.

  Example:
    >>> idle_fraction(gpipe(4, 12)) == bubble_fraction(4, 12)
    True
  """
  if executed and not isinstance(executed[0], Executed):
    slots = [a for slot in executed for a in slot]
    return sum(a is None for a in slots) / len(slots)
  ranks = {e.rank for e in executed}
  makespan = max(e.end for e in executed) - min(e.start for e in executed)
  busy = sum(e.end - e.start for e in executed)
  return 1.0 - busy / (len(ranks) * makespan)


def programs(stage_ranks: Sequence[int], micro_batches: int) -> dict[int, list[Action]]:
  """Each rank's actions, in order: its forwards in GPipe slot order, then backwards, reversed.

  Example:
    >>> [f"{a.kind}{a.stage}.{a.micro}" for a in programs([0, 1], 2)[1]]
    ['F1.0', 'F1.1', 'B1.1', 'B1.0']
  """
  _check(len(stage_ranks), micro_batches, "programs")
  forward: dict[int, list[Action]] = {r: [] for r in stage_ranks}
  order = sorted((s + m, -s, s, m) for s in range(len(stage_ranks))
                  for m in range(micro_batches))
  for _, _, s, m in order:
    forward[stage_ranks[s]].append(Action("F", s, m))
  return {r: acts + [Action("B", a.stage, a.micro) for a in reversed(acts)]
          for r, acts in forward.items()}


def _steps(action: Action, stage_ranks: Sequence[int], cost: float) -> list[tuple]:
  """An action as primitives: ``("recv", peer, tag)``, ``("run", cost)``, ``("send", ...)``."""
  s, last = action.stage, len(stage_ranks) - 1
  here = stage_ranks[s]
  before = stage_ranks[s - 1] if s > 0 else here
  after = stage_ranks[s + 1] if s < last else here
  if action.kind == "F":  # the activation comes from stage s - 1 and goes to s + 1
    steps = [("recv", before, ("F", s, action.micro))] if before != here else []
    steps.append(("run", cost))
    return steps + ([("send", after, ("F", s + 1, action.micro))] if after != here else [])
  steps = [("recv", after, ("B", s, action.micro))] if after != here else []
  steps.append(("run", cost))
  return steps + ([("send", before, ("B", s - 1, action.micro))] if before != here else [])


def simulate(progs: Mapping[int, Sequence[Action]], stage_ranks: Sequence[int], *,
             costs: Mapping[str, Sequence[float]] | None = None,
             eager: bool = False) -> list[Executed]:
  """Runs `progs` with blocking sends (`eager`: buffered); returns the `Executed` actions.

  `costs`: ``{"F": [per stage], "B": [per stage]}`` (default 1). `ScheduleError` on deadlock.

  Example:
    >>> run = simulate(programs([0, 1, 2], 6), [0, 1, 2])
    >>> max(e.end for e in run), round(idle_fraction(run), 4) == round(bubble_fraction(3, 6), 4)
    (16.0, True)
  """
  costs = costs or {"F": [1.0] * len(stage_ranks), "B": [1.0] * len(stage_ranks)}
  queues = {r: [(a, step) for a in acts for step in _steps(a, stage_ranks, costs[a.kind][a.stage])]
            for r, acts in progs.items()}
  position = {r: 0 for r in queues}
  clock = {r: 0.0 for r in queues}
  mailbox: dict[tuple[int, int], list[tuple[tuple, float]]] = {}
  executed: list[Executed] = []

  def pending(rank: int):
    return queues[rank][position[rank]] if position[rank] < len(queues[rank]) else None

  def mismatch(sender: int, receiver: int, sent: tuple, wanted: tuple) -> ScheduleError:
    return ScheduleError(
        f"simulate: rank {sender} sends {sent} to rank {receiver}, whose next receive from it"
        f" expects {wanted}: the two ranks' programs order their messages differently.")

  progress = True
  while progress:
    progress = False
    for rank in queues:
      entry = pending(rank)
      if entry is None:
        continue
      action, step = entry
      if step[0] == "run":
        executed.append(Executed(action, rank, clock[rank], clock[rank] + step[1]))
        clock[rank] += step[1]
      elif step[0] == "send" and eager:
        mailbox.setdefault((rank, step[1]), []).append((step[2], clock[rank]))
      elif step[0] == "send":
        peer = pending(step[1])
        if peer is None or peer[1][0] != "recv" or peer[1][1] != rank:
          continue
        if peer[1][2] != step[2]:
          raise mismatch(rank, step[1], step[2], peer[1][2])
        clock[rank] = clock[step[1]] = max(clock[rank], clock[step[1]])
        position[step[1]] += 1
      else:  # recv: completed by the sender's step (rendezvous) or from the mailbox (eager)
        box = mailbox.get((step[1], rank))
        if not eager or not box:
          continue
        tag, when = box.pop(0)
        if tag != step[2]:
          raise mismatch(step[1], rank, tag, step[2])
        clock[rank] = max(clock[rank], when)
      position[rank] += 1
      progress = True
  blocked = {r: pending(r) for r in queues if pending(r) is not None}
  if blocked:
    waits = "; ".join(f"rank {r} at {a.kind}{a.stage}.{a.micro} waits to {s[0]} {s[2]}"
                      f" {'to' if s[0] == 'send' else 'from'} rank {s[1]}"
                      for r, (a, s) in blocked.items())
    raise ScheduleError(
        f"simulate: the programs deadlock with blocking sends: {waits}. A rank that holds"
        " several stages of a chain that comes back to it (ranks like [0, 1, 0]) sends and"
        " receives across the same pair both ways in one slot; place each stage on its own"
        " rank for a pipelined step, or run the chain without micro-batches.")
  return executed
