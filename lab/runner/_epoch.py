"""One epoch of the training loop: its steps, checkpoints and the stop a signal asks for.

`run_epoch` runs the train step over an epoch's batches (from any batch on, for a resumed
run) with everything each step needs around it: the watchdog and timeline marks, the
divergence check on `mnjax.skip_nonfinite`'s counters every `DIVERGENCE_CHECK_EVERY` steps,
the progress bar, a checkpoint every ``checkpoint_steps`` steps, and on a preemption signal a
last checkpoint and `Preempted` on every rank. `flushed` is what a checkpoint of rank 0 must
hold with double buffering; with local SGD the epoch's last step ends the round and `met`
takes the meeting's bits (after a signal, the next step does, then the checkpoint).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from lab.runner._classifier import TrainState
from lab.runner._preemption import Preempted, PreemptionSignals
from lab.runner._profile import StepProfiler
from lab.runner._run_config import RunConfig
from mnjax.comm._communicator import Communicator
from mnjax.guard import Timeline
from mnjax.guard._watchdog import Watchdog
from mnjax.optim import LocalSGDState, meet_next_step
from mnjax.optim._nonfinite import raise_if_diverging
from mnjax.train._pending import flush_pending

__all__ = ["DIVERGENCE_CHECK_EVERY", "flushed", "met", "run_epoch"]

# Reading the skip counter waits for a step: every 10 steps it costs nothing measurable.
DIVERGENCE_CHECK_EVERY = 10


def flushed(state: TrainState, comm: Communicator, config: RunConfig) -> TrainState:
  """With double buffering, `state` with its pending gradient summed over the ranks
  (`mnjax.train.flush_pending`): what a checkpoint of rank 0 must hold. The run trains on
  with it, so a resumed run is bitwise the uninterrupted one."""
  if not config.double_buffering:
    return state
  return state.replace(opt_state=flush_pending(state.opt_state, comm))


def met(state: TrainState) -> TrainState:
  """`state` right after a `mnjax.optim.local_sgd` meeting, with its parameters set to the
  meeting's anchor: the same bits on every replica (what evaluation, the replica comparison
  and a checkpoint of rank 0 need). The run trains on with it."""
  found = [s for s in jax.tree.leaves(state.opt_state, is_leaf=_is_local) if _is_local(s)]
  return state.replace(params=jax.tree.map(jnp.copy, found[0].anchor))  # not an alias


def _is_local(x: Any) -> bool:
  return isinstance(x, LocalSGDState)


def run_epoch(config: RunConfig, comm: Communicator, state: TrainState, sums: Any, step: int,
              *, train_step: Callable, batches: Iterable, epoch: int, begin: int, steps: int,
              watchdog: Watchdog | None, checkpoints: Any, preemption: PreemptionSignals,
              profiler: StepProfiler, timeline: Timeline | None = None):
  """Steps ``begin .. steps - 1`` of `epoch` -> ``(state, sums, step, images, input wait,
  seconds)``; checkpoints every ``config.checkpoint_steps`` steps, and raises `Preempted`
  after a checkpoint when `preemption` reports a signal."""
  bar = tqdm(total=steps - begin, desc=f"epoch {epoch}", leave=False,
             disable=not (comm.is_root and config.progress))
  iterator = iter(batches)
  images, waited, stopping = 0, 0.0, 0
  start = time.perf_counter()
  try:
    for i in range(begin, steps):
      if watchdog is not None:
        watchdog.step(step)
      if timeline is not None:
        timeline.step(step)
      before = time.perf_counter()
      batch = next(iterator, None)
      waited += time.perf_counter() - before
      if batch is None:
        raise ValueError(f"train_loop: batches({epoch}, {begin}) ended after {i - begin}"
                         f" batches; steps_per_epoch is {steps}.")
      # Local SGD: the replicas meet at the epoch's end, and one step after a signal.
      meeting = bool(config.local_sgd) and (i == steps - 1 or bool(stopping))
      if meeting:
        state = state.replace(opt_state=meet_next_step(state.opt_state))
      previous = state
      with profiler.before(step):
        state, metrics = train_step(state, batch[0], batch[1])
      if meeting:
        state = met(state)
      if step % DIVERGENCE_CHECK_EVERY == 0:  # the previous step's counter: read meanwhile
        raise_if_diverging(previous.opt_state, config.max_consecutive_skips,
                           comm if config.local_sgd else None)  # local skips: agree
      sums = jax.tree.map(lambda a, b: a + b, sums, metrics)
      images += len(batch[1])
      step += 1
      profiler.after(step, state)
      bar.update()
      saved = bool(config.checkpoint_steps) and step % config.checkpoint_steps == 0
      if saved:
        state = flushed(state, comm, config)
        checkpoints.save(step, state, sums, epoch, i + 1)
      signum = stopping or preemption.poll()
      if signum and config.local_sgd and not meeting:  # the replicas differ: meet first
        stopping = signum
        continue
      if signum:
        if not saved:  # flushing twice would sum the pending gradients twice
          state = flushed(state, comm, config)
          checkpoints.save(step, state, sums, epoch, i + 1)
        checkpoints.wait()
        _stop(comm, config, signum, step, epoch, i + 1)
    jax.block_until_ready(state)
  finally:
    bar.close()
    if hasattr(iterator, "close"):  # a generator: stop its prefetching now
      iterator.close()
  return state, sums, step, images, waited, max(time.perf_counter() - start, 1e-9)


def _stop(comm: Communicator, config: RunConfig, signum: int, step: int, epoch: int,
          batch: int):
  """Raises `Preempted` (on every rank) after the checkpoint a signal asked for."""
  name = signal.Signals(signum).name
  if comm.is_root:
    print(f"mnjax: {name} received: checkpointed at step {step} (epoch {epoch}, batch"
          f" {batch}) in {config.workdir}/checkpoints; stopping. Run the same command with"
          " --resume to continue (a requeued Slurm job resumes by itself).", flush=True)
  raise Preempted(128 + signum)

