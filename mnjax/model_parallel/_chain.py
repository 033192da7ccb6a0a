"""`MultiNodeChain`: ChainerMN's ``MultiNodeChainList`` (docs/design/model_parallel.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host._agreement import gather_if_different
from mnjax.model_parallel import _schedule as schedule
from mnjax.model_parallel._messages import connected, recv_tree, send_tree
from mnjax.model_parallel._messages import spec as spec_of

__all__ = ["MultiNodeChain"]


def _key(stage: int) -> str:
  return f"stage_{stage}"


def _arguments(values: Sequence[Any]) -> tuple[Any, ...]:
  """A stage's positional arguments: its inputs, a single tuple unpacked (``link(*x)``)."""
  if len(values) == 1 and isinstance(values[0], tuple):
    return tuple(values[0])
  return tuple(values)


def _stage_inputs(s: int, stage: Any) -> tuple[int | None, ...]:
  """Stage s's inputs: its third element, else the previous stage (None: the model's input)."""
  if len(stage) == 2:
    return (s - 1 if s else None,)
  inputs = stage[2]
  inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
  for i in inputs:
    if not (i is None or (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < s)):
      raise ValueError(
          f"MultiNodeChain: stage {s} takes {i!r} as an input; an input is None (the"
          f" model's input) or an earlier stage's index (0..{s - 1}): stages are listed in"
          " the order they run, each after the stages it takes.")
  if not inputs:
    raise ValueError(f"MultiNodeChain: stage {s} takes no input; give it None (the model's"
                     " input) or earlier stages' indices.")
  return inputs


class _Op(NamedTuple):
  """``run`` stage `stage`, or ``send``/``recv`` its output to/from stage `to`'s rank."""
  kind: str
  stage: int
  to: int
  micro: int


class MultiNodeChain:
  """A graph of flax modules placed on ranks; every rank builds the same one, runs its own.

  Args:
    comm: the `Communicator` the stages' ranks are ranks of (``flat``: one device per
      process; under data x model parallelism, the model communicator of ``comm.split``).
    stages: ``[(module, rank), ...]`` in the order they run; a stage takes the previous
      stage's output (stage 0 the model's input), or what ``(module, rank, inputs)`` names:
      an earlier stage's index, ``None`` for the model's input, or a tuple of them (several
      inputs, ChainerMN's ``rank_in`` list; a stage taken by several stages is sent to each,
      ChainerMN's ``rank_out`` list). Activations are any pytree of arrays; a stage gets its
      inputs as positional arguments, a single tuple unpacked (``module(*x)``). The last
      stage's output is the model's; every other stage's must be taken by a later stage.
    micro_batches: M >= 1; above 1, `loss` runs GPipe over M micro-batches of the batch
      (its leading axis must divide by M) through a chain (each stage taking the previous
      one's output) whose ranks do not come back to a rank.

  Raises (on every rank, before any message): `TypeError`/`ValueError` for a bad stage,
  `schedule.ScheduleError` for a deadlocking chain, `ValueError` for differing chains.

  Example:
    >>> import flax.linen as nn
    >>> chain = mnjax.model_parallel.MultiNodeChain(comm, [(nn.Dense(4), 0), (nn.Dense(2), 0)])
    >>> x = jnp.ones((3, 5))
    >>> params = chain.init(jax.random.key(0), x)
    >>> sorted(params), chain.apply(params, x).shape
    (['stage_0', 'stage_1'], (3, 2))
    >>> loss = lambda out, y: jnp.mean((out - y) ** 2)
    >>> grads = jax.grad(chain.loss)(params, x, jnp.zeros((3, 2)), loss)
    >>> tx = chain.optimizer(optax.sgd(0.1))
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> class Add(nn.Module):
    ...   def __call__(self, a, b):
    ...     return a + b
    >>> joined = mnjax.model_parallel.MultiNodeChain(
    ...     comm, [(nn.Dense(4), 0), (nn.Dense(4), 0, None), (Add(), 0, (0, 1))])
    >>> joined.apply(joined.init(jax.random.key(0), x), x).shape
    (3, 4)
  """

  def __init__(self, comm: Communicator, stages: Sequence[tuple[Any, ...]], *,
               micro_batches: int = 1):
    check_communicator(comm, "MultiNodeChain")
    stages = list(stages) if isinstance(stages, (list, tuple)) else stages
    if not isinstance(stages, list) or not stages:
      raise ValueError(f"MultiNodeChain: stages must be a non-empty list of (module, rank)"
                       f" or (module, rank, inputs), got {stages!r}.")
    for s, stage in enumerate(stages):
      if not (isinstance(stage, (tuple, list)) and len(stage) in (2, 3)):
        raise TypeError(f"MultiNodeChain: stage {s} must be a (module, rank) pair or a"
                        f" (module, rank, inputs) triple, got {stage!r}.")
      module, rank = stage[:2]
      if not (hasattr(module, "init") and hasattr(module, "apply")):
        raise TypeError(f"MultiNodeChain: stage {s}'s module must be a flax module (with"
                        f" init and apply), got {type(module).__name__}.")
      if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < comm.size:
        raise ValueError(f"MultiNodeChain: stage {s} is placed on rank {rank!r}, but the"
                         f" communicator has ranks 0..{comm.size - 1}. Place every stage"
                         " on a rank of the communicator passed (a model communicator of"
                         " comm.split under data x model parallelism).")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or (
        micro_batches < 1):
      raise ValueError(f"MultiNodeChain: micro_batches must be an int >= 1, got"
                       f" {micro_batches!r}.")
    self.comm = comm
    self.modules = [stage[0] for stage in stages]
    self.stage_ranks = [stage[1] for stage in stages]
    #: Each stage's inputs: earlier stages' indices, None for the model's input.
    self.stage_inputs = [_stage_inputs(s, stage) for s, stage in enumerate(stages)]
    self.micro_batches = micro_batches
    last = len(stages) - 1
    taken = {i for inputs in self.stage_inputs for i in inputs}
    unused = [s for s in range(last) if s not in taken]
    if unused:
      raise ValueError(f"MultiNodeChain: the output of stage {unused[0]} goes nowhere: only"
                       f" the last stage ({last}) gives the model's output. Make a later"
                       f" stage take it (its inputs), or leave the stage out.")
    chain = all(inputs == (s - 1 if s else None,) for s, inputs in
                enumerate(self.stage_inputs))
    if micro_batches > 1 and not chain:
      raise ValueError(f"MultiNodeChain: micro_batches={micro_batches} (GPipe) runs over a"
                       " chain, each stage taking the previous one's output; this one has"
                       " stages with other inputs. Use micro_batches=1 for it.")
    described = (repr(self.modules), self.stage_ranks, self.stage_inputs, micro_batches)
    everyone = gather_if_different(comm, "MultiNodeChain", described, what="MultiNodeChain")
    if everyone is not None:
      other = next(r for r, d in enumerate(everyone) if d != everyone[0])
      raise ValueError(
          f"MultiNodeChain: the ranks built different chains: rank 0 {everyone[0]!r:.300},"
          f" rank {other} {everyone[other]!r:.300}. Every rank must build the same chain"
          " (all the stages, with their ranks and inputs), and run only its own.")
    if micro_batches > 1:
      program = schedule.programs(self.stage_ranks, micro_batches)
      schedule.simulate(program, self.stage_ranks)  # raises ScheduleError on a deadlock
      self._ops = self._piped(program.get(comm.rank, []))
    else:
      self._ops = self._in_order()

  def _in_order(self) -> list[_Op]:
    """This rank's forward: each message just before its consumer, one order on every rank."""
    me, ops = self.comm.rank, []
    for s, inputs in enumerate(self.stage_inputs):
      for p in dict.fromkeys(i for i in inputs if i is not None):
        if self.stage_ranks[p] != self.stage_ranks[s]:
          if self.stage_ranks[p] == me:
            ops.append(_Op("send", p, s, 0))
          if self.stage_ranks[s] == me:
            ops.append(_Op("recv", p, s, 0))
      if self.stage_ranks[s] == me:
        ops.append(_Op("run", s, s, 0))
    return ops

  def _piped(self, program: Sequence[schedule.Action]) -> list[_Op]:
    """This rank's GPipe forward: each forward action between its receive and its send."""
    ranks, last, ops = self.stage_ranks, len(self.stage_ranks) - 1, []
    for action in program:
      if action.kind != "F":
        continue
      s, m = action.stage, action.micro
      if s > 0 and ranks[s - 1] != ranks[s]:
        ops.append(_Op("recv", s - 1, s, m))
      ops.append(_Op("run", s, s, m))
      if s < last and ranks[s + 1] != ranks[s]:
        ops.append(_Op("send", s, s + 1, m))
    return ops

  @property
  def own_stages(self) -> list[int]:
    """The stages this rank runs."""
    return [s for s, r in enumerate(self.stage_ranks) if r == self.comm.rank]

  @property
  def output_rank(self) -> int:
    """The rank of the last stage: where `apply` returns the output and `loss` the loss."""
    return self.stage_ranks[-1]

  def _outputs(self, x: Any) -> list[Any]:
    """Each stage's output (shapes and dtypes) for a batch like `x`."""
    spec, outputs = spec_of(x), []
    for module, inputs in zip(self.modules, self.stage_inputs, strict=True):
      args = _arguments([spec if i is None else outputs[i] for i in inputs])
      out, _ = jax.eval_shape(module.init_with_output, jax.random.key(0), *args)
      outputs.append(out)
    return outputs

  def _init(self, rng: jax.Array, x: Any, stages: Sequence[int]) -> dict[str, Any]:
    spec, outputs = spec_of(x), self._outputs(x)
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731
    return {_key(s): self.modules[s].init(jax.random.fold_in(rng, s), *_arguments(
        [zeros(spec if i is None else outputs[i]) for i in self.stage_inputs[s]]))
            for s in stages}

  def init(self, rng: jax.Array, x: Any) -> dict[str, Any]:
    """This rank's stages' variables, ``{"stage_<s>": ...}``; `x` may be shapes. No message."""
    return self._init(rng, x, self.own_stages)

  def init_all(self, rng: jax.Array, x: Any) -> dict[str, Any]:
    """Every stage's variables, as the ranks' `init` give them together."""
    return self._init(rng, x, range(len(self.modules)))

  def apply_all(self, params: dict[str, Any], x: Any) -> Any:
    """The whole model in one process, with `init_all`'s parameters."""
    outputs: list[Any] = []
    for s, (module, inputs) in enumerate(zip(self.modules, self.stage_inputs, strict=True)):
      args = _arguments([x if i is None else outputs[i] for i in inputs])
      outputs.append(module.apply(params[_key(s)], *args))
    return outputs[-1]

  def _run(self, params: dict[str, Any], xs: Any, targets: Any, loss_fn: Callable | None,
           micro: int) -> Any:
    """This rank's forward: the loss or output on the output rank, else the delegates."""
    ranks, last = self.stage_ranks, len(self.modules) - 1
    batch = jax.tree.map(lambda a: a[0], xs)
    specs = self._outputs(batch)
    values: dict[tuple[int, int], Any] = {}  # (stage, micro): an output this rank holds
    received: dict[tuple[int, int, int], Any] = {}  # (stage, to, micro): a message's value
    outputs = []
    delegate = None
    for op in self._ops:
      s, m = op.stage, op.micro
      if op.kind == "send":
        delegate = send_tree(values[(s, m)], self.comm, ranks[op.to], delegate)
        continue
      if op.kind == "recv":
        received[(s, op.to, m)] = recv_tree(specs[s], self.comm, ranks[s], delegate)
        continue
      args = []
      for i in self.stage_inputs[s]:
        if i is None:
          args.append(jax.tree.map(lambda a, m=m: a[m], xs))
        else:
          args.append(values[(i, m)] if ranks[i] == ranks[s] else received[(i, s, m)])
      h = self.modules[s].apply(params[_key(s)], *_arguments(args))
      values[(s, m)] = h
      if s == last:
        outputs.append(h if loss_fn is None else loss_fn(
            h, jax.tree.map(lambda a, m=m: a[m], targets)))
    if outputs:
      result = (outputs[0] if loss_fn is None and micro == 1
                else jax.tree.map(lambda *o: jnp.concatenate(o), *outputs)
                if loss_fn is None else sum(outputs[1:], outputs[0]) / micro)
      return connected(delegate, result)
    if not self._ops:  # a rank that holds no stage: in the step's check all the same
      from mnjax.functions._transport import take_part  # noqa: PLC0415 (the in-step transport)

      take_part(self.comm)
    return jnp.zeros((), jnp.float32) if delegate is None else delegate

  def _split(self, x: Any, name: str) -> Any:
    """`x` (a pytree) with a leading micro-batch axis on every leaf."""
    micro = self.micro_batches
    if x is None:
      return None

    def split(a: Any) -> jax.Array:
      if jnp.ndim(a) == 0 or jnp.shape(a)[0] % micro:
        raise ValueError(f"MultiNodeChain: the {name}'s leading axis ({jnp.shape(a)}) must"
                         f" divide by micro_batches={micro}.")
      return jnp.reshape(a, (micro, jnp.shape(a)[0] // micro, *jnp.shape(a)[1:]))

    return jax.tree.map(split, x)

  def apply(self, params: dict[str, Any], x: Any) -> Any:
    """The forward, in the jitted step: the output on `output_rank`, a delegate elsewhere."""
    return self._run(params, self._split(x, "batch"), None, None, self.micro_batches)

  def loss(self, params: dict[str, Any], x: Any, target: Any,
           loss_fn: Callable[[Any, Any], jax.Array]) -> jax.Array:
    """``loss_fn(output, target)`` on `output_rank` (mean over micro-batches), else a delegate."""
    return self._run(params, self._split(x, "batch"), self._split(target, "target"), loss_fn,
                     self.micro_batches)

  def optimizer(self, tx: optax.GradientTransformation
                | Sequence[optax.GradientTransformation], *, every_stage: bool = False
                ) -> optax.GradientTransformation:
    """Runs `tx` (or ``tx[s]``) on each of this rank's stages (`every_stage`: all stages)."""
    single = isinstance(tx, optax.GradientTransformation)  # a NamedTuple: test it first
    txs = [tx] * len(self.modules) if single else list(tx)
    if len(txs) != len(self.modules):
      raise ValueError(f"MultiNodeChain.optimizer: {len(txs)} transformations for"
                       f" {len(self.modules)} stages; pass one, or one per stage.")
    stages = range(len(self.modules)) if every_stage else self.own_stages
    return optax.multi_transform({_key(s): txs[s] for s in stages},
                                 {_key(s): _key(s) for s in stages})
