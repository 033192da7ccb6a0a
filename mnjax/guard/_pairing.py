"""The pre-flight check of a model-parallel step: do every rank's sends and receives pair up?

`check_exchanges` runs the ranks' sequences against each other with MPI's strictest semantics,
so an accepted step cannot deadlock. Design: docs/design/functions.md, "The pairing check"."""

from __future__ import annotations

from typing import NamedTuple

from mpi4py import MPI

from mnjax.comm._instep._entry_tag import TAG as _TAG
from mnjax.comm._instep._entry_tag import entry, world_ranks

__all__ = ["ExchangeError", "check_exchanges", "describe_refusals", "entry", "has_refusal",
           "involved", "parse", "refusal_error", "world_ranks"]

_LIMIT = 4  # problems named in one message
_UNTAGGED = "every rank"  # the phase of an untagged entry (SyncBatchNorm, a gradient bucket)


class ExchangeError(ValueError):
  """The ranks' in-step exchanges would not pair up, or a call was refused (on every rank)."""


class Exchange(NamedTuple):
  """One parsed entry of a rank's collective sequence."""

  kind: str  # "send", "recv", "collective" or "refused"
  label: str
  peer: int | None  # a world rank (send / recv)
  phase: str | None  # "forward" (activations) or "gradient"
  group: tuple[int, ...]  # world ranks taking part (a collective's members; a pair)
  shape: tuple
  dtype: str
  comm: int | None = None  # the communicator's uid: exchanges pair over one communicator


def parse(what: str, shape: tuple, dtype: str) -> Exchange | None:
  """The `Exchange` an entry describes, or None for an untagged one (an SPMD collective).

  Example:
    >>> parse(entry("recv", "recv", (0, 1), peer=0, phase="forward"), (3,), "float32").peer
    0
  """
  found = _TAG.search(what)
  if found is None:
    return None
  group = tuple(int(g) for g in found["group"].split(",") if g)
  return Exchange(found["kind"], what[:found.start()], None if found["peer"] is None
                  else int(found["peer"]), found["phase"], group, tuple(shape), dtype,
                  None if found["comm"] is None else int(found["comm"]))


def involved(everyone: list[tuple]) -> bool:
  """Whether any rank's sequence holds an `mnjax.functions` exchange.

  Example:
    >>> involved([(("allreduce_tree bucket 1 of 1", (3,), "float32"),)])
    False
  """
  return any(_TAG.search(what) for seq in everyone for what, _, _ in seq)


def check_exchanges(everyone: list[tuple], mpi_comm: MPI.Comm | None, *, caller: str,
                    world: tuple[int, ...] | None = None) -> None:
  """Raises `ExchangeError` (on every rank) unless the sequences complete against each other.
  ``everyone[r]`` is rank ``r``'s; `world` gives each one's ``MPI.COMM_WORLD`` rank.

  Example:
    >>> a = (entry("send", "send", (0, 1), peer=1, phase="forward"), (3,), "float32")
    >>> b = (entry("recv", "recv", (0, 1), peer=0, phase="forward"), (3,), "float32")
    >>> check_exchanges([(a,), (b,)], MPI.COMM_WORLD, caller="jit")  # pairs up
    >>> b4 = (b[0], (4,), "float32")
    >>> try:
    ...   check_exchanges([(a,), (b4,)], MPI.COMM_WORLD, caller="jit")
    ... except ExchangeError as e:
    ...   print(str(e)[:54])
    jit: the ranks' in-step exchanges do not pair up, so t
  """
  if world is None:
    world = (world_ranks(mpi_comm) if len(everyone) == mpi_comm.Get_size()
             else tuple(range(len(everyone))))
  run = _Run(everyone, world)
  refused = run.refused()
  if refused:
    raise ExchangeError(f"{caller}: an exchange of the step was refused while it was traced, so"
                        " no rank runs it: " + "; ".join(refused) + ". Nothing was exchanged.")
  problems = run.problems()
  if problems:
    raise ExchangeError(
        f"{caller}: the ranks' in-step exchanges do not pair up, so the step would wait"
        " forever in an exchange no rank answers (or receive unrelated bytes). "
        + "; ".join(problems[:_LIMIT]) + ("; ..." if len(problems) > _LIMIT else "")
        + ". Every mnjax.functions.send(x, comm, dest) needs an"
        " mnjax.functions.recv(comm, source, like) on `dest`, with `like` of x's shape and"
        " dtype, at the same place in both ranks' order of exchanges (a rank that sends"
        " and receives on a ring must receive first on one side), and both ranks must call"
        " them inside the functions they differentiate, or both outside. Nothing was"
        " exchanged.")


class _Run:
  """The ranks' sequences run against each other, to the end or until no exchange can go."""

  def __init__(self, everyone: list[tuple], world: tuple[int, ...]):
    self.index = {w: r for r, w in enumerate(world)}
    self.world = world
    everyone_group = tuple(world)
    self.seqs = [[parse(what, shape, dtype) or Exchange(
        "collective", what, None, _UNTAGGED, everyone_group, tuple(shape), dtype)
        for what, shape, dtype in seq] for seq in everyone]
    self.pos = [0] * len(everyone)

  def head(self, r: int) -> Exchange | None:
    seq = self.seqs[r]
    return seq[self.pos[r]] if self.pos[r] < len(seq) else None

  def rank(self, world_rank: int | None) -> int | None:
    return self.index.get(world_rank)

  def refused(self) -> list[str]:
    return [f"rank {r}: {e.label}" for r, seq in enumerate(self.seqs) for e in seq
            if e.kind == "refused"]

  def problems(self) -> list[str]:
    outside = self._outside()
    if outside:
      return outside
    while self._advance():
      pass
    return [p for r in range(len(self.seqs)) if (p := self._stuck(r))]

  def _outside(self) -> list[str]:
    out = []
    for r, seq in enumerate(self.seqs):
      for e in seq:
        strangers = [w for w in (*e.group, *(() if e.peer is None else (e.peer,)))
                     if w not in self.index]
        if strangers:
          out.append(f"rank {r}'s {_show(e, self)} involves world rank(s) {strangers}, which"
                     " the step's communicator does not hold: check the step over a"
                     " communicator holding every rank it exchanges with")
          break
    return out

  def _advance(self) -> bool:
    moved = False
    for r in range(len(self.seqs)):
      e = self.head(r)
      if e is None:
        continue
      if e.kind == "send":
        q = self.rank(e.peer)
        f = self.head(q)
        if f is not None and _pairs(e, f, self.world[r]):
          self.pos[r] += 1
          self.pos[q] += 1
          moved = True
      elif e.kind == "collective":
        members = [self.rank(w) for w in e.group]
        if r in members and all(_same(self.head(m), e) for m in members):
          for m in members:
            self.pos[m] += 1
          moved = True
    return moved

  def _stuck(self, r: int) -> str | None:
    e = self.head(r)
    if e is None:
      return None
    where = f"rank {r}'s exchange {self.pos[r] + 1} ({_show(e, self)})"
    if e.kind == "collective":
      members = [self.rank(w) for w in e.group]
      if r not in members:
        return f"{where} is over ranks {members}, which do not include rank {r}"
      others = [f"rank {m} at {_at(self.head(m), self)}" for m in members
                if not _same(self.head(m), e)]
      hint = "" if e.phase != _UNTAGGED else (
          " (a collective that names no ranks, one over the whole job such as a SyncBatchNorm"
          " layer's or a gradient bucket's, reads as one over every rank of the checked"
          " communicator: run it over a sub-communicator of the ranks that take part,"
          " comm.split)")
      return f"{where} waits for {', '.join(others)}{hint}"
    q = self.rank(e.peer)
    f = self.head(q)
    if e.kind == "recv" and f is not None and f.kind == "send" and self.rank(f.peer) == r:
      return None  # the sender's side says it
    verb = "sends" if e.kind == "send" else "receives"
    if f is None:
      hint = (f" (a gradient: rank {q} has no backward for this exchange; it must run inside"
              f" the function rank {q} differentiates, and its result must reach the loss:"
              " use it, or mnjax.functions.pseudo_connect it)")
      return (f"{where}: rank {r} {verb}, but rank {q}'s step has no exchange left"
              + (hint if e.phase == "gradient" else ""))
    if {e.kind, f.kind} == {"send", "recv"} and self.rank(f.peer) == r:
      if e.comm != f.comm:
        return (f"{where} meets rank {q}'s {_show(f, self)} over another communicator of the"
                " same ranks (messages never cross communicators: each would wait for its"
                " own). Send and receive over the same communicator object on both ranks")
      if e.phase != f.phase:
        return (f"{where} meets rank {q}'s {_show(f, self)}: one is an activation, the"
                " other a gradient (one rank differentiates through the exchange, the other"
                " does not)")
      return (f"{where} meets rank {q}'s {_show(f, self)}: the shapes or dtypes differ"
              " (the receiver's `like` must have the sender's shape and dtype)")
    if e.kind == "send" and f.kind == "send":
      return (f"{where} while rank {q} sends too ({_show(f, self)}): both send first and"
              " neither receives (a deadlock once messages pass MPI's eager limit); let"
              " one of them receive first")
    return f"{where}, but rank {q} is at {_at(f, self)}"


def _pairs(send: Exchange, other: Exchange | None, sender_world: int) -> bool:
  return (other is not None and other.kind == "recv" and other.peer == sender_world
          and (other.shape, other.dtype, other.phase, other.comm)
          == (send.shape, send.dtype, send.phase, send.comm))


def _same(e: Exchange | None, f: Exchange) -> bool:
  return e is not None and e.kind == "collective" and e == f


def _at(e: Exchange | None, run: _Run) -> str:
  return "the end of its step" if e is None else _show(e, run)


def _show(e: Exchange, run: _Run) -> str:
  payload = f"{e.dtype}{list(e.shape)}"
  if e.kind == "send":
    return f"{e.label}: sends {e.phase} {payload} to rank {run.rank(e.peer)}"
  if e.kind == "recv":
    return f"{e.label}: receives {e.phase} {payload} from rank {run.rank(e.peer)}"
  return f"{e.label} {payload}"


def describe_refusals(sequence: tuple) -> list[str]:
  """The refusals in one rank's own sequence (a call refused while its step was traced).

  Example:
    >>> describe_refusals(((entry("send: dest=5 is outside", "refused", ()), (), ""),))
    ['send: dest=5 is outside']
  """
  return [e.label for what, shape, dtype in sequence
          if (e := parse(what, shape, dtype)) is not None and e.kind == "refused"]


def has_refusal(sequence: tuple) -> bool:
  """Whether one rank's own sequence holds a refused call.

  Example:
    >>> has_refusal(())
    False
  """
  return bool(describe_refusals(sequence))


def refusal_error(sequence: tuple, *, caller: str) -> ExchangeError:
  """The error for refusals that every rank noted alike (their sequences were equal).

  Example:
    >>> str(refusal_error(((entry("bad dest", "refused", ()), (), ""),), caller="jit"))[:18]
    'jit: every rank: b'
  """
  return ExchangeError(f"{caller}: every rank: " + "; ".join(describe_refusals(sequence))
                      + ". Nothing was exchanged.")
