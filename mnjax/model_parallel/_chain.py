"""A model whose stages live on different ranks: ChainerMN's ``MultiNodeChainList`` as a
functional chain of flax modules, with GPipe micro-batching over the same stages.

Every rank builds the same `MultiNodeChain` (all ``(module, rank)`` stages) and runs only
its own stages in its jitted step, passing activations with `mnjax.functions.send` /
``recv``; ``jax.grad`` of `loss` on every rank runs the backward. ``micro_batches=M`` runs
GPipe (`mnjax.model_parallel._schedule.programs`). Design: docs/design/model_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host._agreement import gather_if_different
from mnjax.model_parallel import _schedule as schedule

__all__ = ["MultiNodeChain"]


def _key(stage: int) -> str:
  return f"stage_{stage}"


def _functions() -> Any:
  """`mnjax.functions`, the in-step transport (imported when a message is traced)."""
  from mnjax import functions  # noqa: PLC0415
  return functions


def _connected(delegate: Any, x: Any) -> Any:
  """`x`, made to depend on `delegate` (`mnjax.functions.pseudo_connect`); `x` without one."""
  if delegate is None:
    return x
  out = _functions().pseudo_connect(delegate, x)
  return out[0] if isinstance(out, (tuple, list)) else out


class MultiNodeChain:
  """A chain of flax modules placed on ranks; every rank builds the same one.

  Args:
    comm: the `Communicator` the stages' ranks are ranks of (``flat``: one device per
      process; under data x model parallelism, the model communicator of ``comm.split``).
    stages: ``[(module, rank), ...]`` in chain order; stage s's output is stage s + 1's
      input, the last stage's output the model's.
    micro_batches: M >= 1; above 1, `loss` runs GPipe over M micro-batches of the batch
      (its leading axis must divide by M); the stages' ranks must not come back to a rank.

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
  """

  def __init__(self, comm: Communicator, stages: Sequence[tuple[Any, int]], *,
               micro_batches: int = 1):
    check_communicator(comm, "MultiNodeChain")
    stages = list(stages) if isinstance(stages, (list, tuple)) else stages
    if not isinstance(stages, list) or not stages:
      raise ValueError(f"MultiNodeChain: stages must be a non-empty list of (module, rank),"
                       f" got {stages!r}.")
    for s, stage in enumerate(stages):
      if not (isinstance(stage, (tuple, list)) and len(stage) == 2):
        raise TypeError(f"MultiNodeChain: stage {s} must be a (module, rank) pair, got"
                        f" {stage!r}.")
      module, rank = stage
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
    self.modules = [m for m, _ in stages]
    self.stage_ranks = [r for _, r in stages]
    self.micro_batches = micro_batches
    #: This rank's actions, forward half only, in the order its step runs them.
    program = schedule.programs(self.stage_ranks, micro_batches)
    if micro_batches > 1:
      schedule.simulate(program, self.stage_ranks)  # raises ScheduleError on a deadlock
    self._forward = [a for a in program.get(comm.rank, []) if a.kind == "F"]
    described = (repr(self.modules), self.stage_ranks, micro_batches)
    everyone = gather_if_different(comm, "MultiNodeChain", described, what="MultiNodeChain")
    if everyone is not None:
      other = next(r for r, d in enumerate(everyone) if d != everyone[0])
      raise ValueError(
          f"MultiNodeChain: the ranks built different chains: rank 0 {everyone[0]!r:.300},"
          f" rank {other} {everyone[other]!r:.300}. Every rank must build the same chain"
          " (all the stages, with their ranks), and run only its own.")

  @property
  def own_stages(self) -> list[int]:
    """The stages this rank runs."""
    return [s for s, r in enumerate(self.stage_ranks) if r == self.comm.rank]

  @property
  def output_rank(self) -> int:
    """The rank of the last stage: where `apply` returns the output and `loss` the loss."""
    return self.stage_ranks[-1]

  def _inputs(self, x: Any) -> list[jax.ShapeDtypeStruct]:
    """Each stage's input (shape and dtype) for a batch like `x`, then the output's."""
    spec = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x.dtype))]
    for module in self.modules:
      out, _ = jax.eval_shape(module.init_with_output, jax.random.key(0), spec[-1])
      spec.append(out)
    return spec

  def _init(self, rng: jax.Array, x: Any, stages: Sequence[int]) -> dict[str, Any]:
    spec = self._inputs(x)
    return {_key(s): self.modules[s].init(jax.random.fold_in(rng, s),
                                          jnp.zeros(spec[s].shape, spec[s].dtype))
            for s in stages}

  def init(self, rng: jax.Array, x: Any) -> dict[str, Any]:
    """This rank's stages' variables, ``{"stage_<s>": module.init(fold_in(rng, s), ...)}``
    (no message; `x`: the batch, or a `jax.ShapeDtypeStruct` like it)."""
    return self._init(rng, x, self.own_stages)

  def init_all(self, rng: jax.Array, x: Any) -> dict[str, Any]:
    """Every stage's variables, as the ranks' `init` give them together."""
    return self._init(rng, x, range(len(self.modules)))

  def apply_all(self, params: dict[str, Any], x: Any) -> Any:
    """The whole chain in one process (`init_all`'s parameters): the reference model."""
    for s, module in enumerate(self.modules):
      x = module.apply(params[_key(s)], x)
    return x

  def _run(self, params: dict[str, Any], xs: Any, targets: Any, loss_fn: Callable | None,
           micro: int) -> Any:
    """This rank's forward: the loss or output on the output rank, else the delegates."""
    me, last = self.comm.rank, len(self.modules) - 1
    spec = self._inputs(jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype))
    local: dict[tuple[int, int], Any] = {}
    outputs = []
    delegate = None
    for action in self._forward:
      s, m = action.stage, action.micro
      if s == 0:
        h = xs[m]
      elif self.stage_ranks[s - 1] == me:
        h = local.pop((s, m))
      else:
        h = _connected(delegate, _functions().recv(self.comm, self.stage_ranks[s - 1], spec[s]))
      h = self.modules[s].apply(params[_key(s)], h)
      if s == last:
        outputs.append(h if loss_fn is None else loss_fn(h, targets[m]))
      elif self.stage_ranks[s + 1] == me:
        local[(s + 1, m)] = h
      else:
        sent = _functions().send(_connected(delegate, h), self.comm, self.stage_ranks[s + 1])
        delegate = sent
    if outputs:
      result = (outputs[0] if loss_fn is None and micro == 1
                else jnp.concatenate(outputs) if loss_fn is None
                else sum(outputs[1:], outputs[0]) / micro)
      return _connected(delegate, result)
    if not self._forward:  # a rank that holds no stage: in the step's check all the same
      from mnjax.functions._transport import take_part  # noqa: PLC0415 (as _functions())

      take_part(self.comm)
    return jnp.zeros((), jnp.float32) if delegate is None else delegate

  def _split(self, x: Any, name: str) -> Any:
    micro = self.micro_batches
    if x is None:
      return None
    if jnp.ndim(x) == 0 or jnp.shape(x)[0] % micro:
      raise ValueError(f"MultiNodeChain: the {name}'s leading axis ({jnp.shape(x)}) must"
                       f" divide by micro_batches={micro}.")
    return jnp.reshape(x, (micro, jnp.shape(x)[0] // micro, *jnp.shape(x)[1:]))

  def apply(self, params: dict[str, Any], x: Any) -> Any:
    """The forward on every rank (inside its jitted step): the model's output on
    `output_rank`, a delegate scalar elsewhere (its gradient runs this rank's backward).
    Micro-batched as `loss` is."""
    return self._run(params, self._split(x, "batch"), None, None, self.micro_batches)

  def loss(self, params: dict[str, Any], x: Any, target: Any,
           loss_fn: Callable[[Any, Any], jax.Array]) -> jax.Array:
    """``loss_fn(output, target)`` on `output_rank` (the mean over micro-batches), a
    delegate elsewhere; ``jax.grad(chain.loss)(params, x, y, loss_fn)`` on every rank is
    this rank's stages' gradient."""
    return self._run(params, self._split(x, "batch"), self._split(target, "target"), loss_fn,
                     self.micro_batches)

  def optimizer(self, tx: optax.GradientTransformation
                | Sequence[optax.GradientTransformation], *, every_stage: bool = False
                ) -> optax.GradientTransformation:
    """An optax transformation for this rank's parameters that runs `tx` (or ``tx[s]``,
    one per stage) on each stage's own; `every_stage`: over `init_all`'s parameters."""
    single = isinstance(tx, optax.GradientTransformation)  # a NamedTuple: test it first
    txs = [tx] * len(self.modules) if single else list(tx)
    if len(txs) != len(self.modules):
      raise ValueError(f"MultiNodeChain.optimizer: {len(txs)} transformations for"
                       f" {len(self.modules)} stages; pass one, or one per stage.")
    stages = range(len(self.modules)) if every_stage else self.own_stages
    return optax.multi_transform({_key(s): txs[s] for s in stages},
                                 {_key(s): _key(s) for s in stages})
