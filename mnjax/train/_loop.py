"""The guarded training loop every experiment runs, and the settings it reads.

`train_loop` runs epochs of a train step over an experiment's batches and owns everything
around the step that must not differ between experiments: resuming from the newest
checkpoint (`mnjax.LoopCheckpoints`, bit for bit, mid-epoch too), the stall watchdog, the
divergence check on `mnjax.skip_nonfinite`'s counters, the replica comparison after every
epoch, exact global metrics, the JSON-lines log, the progress bar, checkpoints every
``checkpoint_steps`` steps and every ``checkpoint_every`` epochs (a save that fails stops
the run on every rank before the next epoch is recorded, and a resumed run cuts
``metrics.jsonl`` back to the checkpoint it resumes from). An experiment builds its
data, model and optimizer and hands over three things: the step, the batches of an epoch
and, optionally, the evaluation batches.

`RunConfig` holds the settings the loop and every experiment share; an experiment's config
dataclass subclasses it with its own fields (see `mnjax.train.parse_flags`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import jax
import optax
from tqdm import tqdm

from mnjax.checkpoint._checkpointer import CheckpointTemplateError
from mnjax.checkpoint._loop import LoopCheckpoints
from mnjax.comm._buckets import bucket_bytes_from_mb
from mnjax.comm._communicator import KINDS, Communicator
from mnjax.comm._wire import check_wire_dtype
from mnjax.guard._consensus import check_replicas
from mnjax.guard._timeline import Timeline, from_env
from mnjax.guard._watchdog import Watchdog
from mnjax.optim._allreduce import allreduce_gradients
from mnjax.optim._double_buffered import double_buffered_optimizer
from mnjax.optim._loss_scale import loss_scale_state
from mnjax.optim._nonfinite import SkipNonFiniteState, raise_if_diverging, skip_nonfinite
from mnjax.optim._shard import shard_optimizer
from mnjax.train._classifier import TrainState, evaluate, zero_sums
from mnjax.train._flags import check_fields, flag
from mnjax.train._lock import WorkdirLock
from mnjax.train._metrics import allreduce_metrics, global_mean
from mnjax.train._pending import flush_pending
from mnjax.train._preemption import Preempted, PreemptionSignals, parse_signals, requeued
from mnjax.train._profile import StepProfiler, profile_window
from mnjax.train._tensorboard import TensorBoard, run_logdir
from mnjax.train._workdir import MetricsLog, write_config

__all__ = ["RunConfig", "guarded_optimizer", "skipped_steps", "train_loop"]

# Reading the skip counter waits for a step: every 10 steps it costs nothing measurable.
DIVERGENCE_CHECK_EVERY = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """The settings every experiment shares: the communicator, the gradient exchange, the
  data order and the loop's guards and checkpoints. Written to ``config.json``.

  Subclass it (``@dataclasses.dataclass(frozen=True, kw_only=True)``) with the
  experiment's fields; ``resume_settings`` names the fields a resumed run must keep.

  Example:
    >>> config = RunConfig(epochs=2, global_batch_size=64, workdir="runs/x")
    >>> config.checkpoint_every, config.stall_timeout
    (1, 300.0)
  """

  # Fields that fix the data order and the optimizer: a resumed run must keep them.
  resume_settings: ClassVar[tuple[str, ...]] = ("global_batch_size", "seed")

  epochs: int = flag(minimum=1, help="train until this epoch (resumed runs: the rest)")
  global_batch_size: int = flag(minimum=1, help="examples per step over all replicas")
  workdir: str = flag(help="config.json, metrics.jsonl, checkpoints/ go here (rank 0)")
  seed: int = flag(0, help="initialisation and data order")
  comm: str = flag("auto", choices=("auto", *KINDS),
                   help="communicator kind; auto: xla on GPUs, flat on CPUs")
  wire_dtype: str = flag("float32", help="gradients cross processes in this dtype (float32,"
                         " bfloat16 or float16)")
  bucket_mb: str = flag("auto", help="largest fused gradient buffer in MiB; auto: the"
                        " platform default; 0: one buffer per dtype")
  double_buffering: bool = flag(False, help="apply the previous step's reduced gradients"
                                " while this step's wait (ChainerMN's double buffering)")
  shard_optimizer: bool = flag(False, help="ZeRO-1: each rank keeps 1/P of the optimizer"
                               " state (mnjax.shard_optimizer; kind flat)")
  progress: bool = flag(True, help="rank 0 shows a progress bar")
  resume: bool = flag(False, help="continue from the newest intact checkpoint in"
                      " <workdir>/checkpoints")
  checkpoint_every: int = flag(1, minimum=0, help="epochs between checkpoints; 0: never")
  checkpoint_steps: int = flag(0, minimum=0, help="also checkpoint every N steps; 0: at"
                               " epoch ends only")
  keep_checkpoints: int = flag(3, minimum=1, help="checkpoints kept")
  max_consecutive_skips: int = flag(10, minimum=0, help="steps with NaN/Inf gradients"
                                    " skipped in a row before the run fails")
  stall_timeout: float = flag(300.0, minimum=0, help="watchdog: seconds ranks may drift"
                              " apart; 0 disables it")
  baseline_workdir: str = flag("", help="a 1-rank run of the same config: report the"
                               " parallel efficiency against it")
  checkpoint_on_signal: str = flag("TERM,USR1", help="signals that make the run checkpoint"
                                   " and stop (Slurm's scancel, --signal); '' for none")
  tensorboard: str = flag("auto", help="TensorBoard scalars of every epoch (rank 0) in this"
                          " directory; auto: <workdir>/tensorboard; '' for none")
  profile_steps: str = flag("", help="jax.profiler trace into <workdir>/profile/rank<r>: N"
                            " steps from the run's second step, or global steps A:B (A .. B-1);"
                            " '' for none")

  def __post_init__(self):
    check_fields(self)
    check_wire_dtype(self.wire_dtype, "--wire_dtype")
    parse_signals(self.checkpoint_on_signal)
    profile_window(self.profile_steps)
    bucket_bytes_from_mb(self.bucket_mb)
    if self.shard_optimizer and self.double_buffering:
      raise ValueError(
          "--shard_optimizer and --double_buffering cannot be combined: the sharded optimizer"
          " exchanges inside its own update (reduce-scatter, then all-gather). Pick one.")


def guarded_optimizer(optimizer: optax.GradientTransformation, comm: Communicator,
                      config: RunConfig) -> optax.GradientTransformation:
  """``optax.chain(allreduce_gradients(comm, ...), skip_nonfinite(optimizer))`` with the
  config's wire dtype and buckets: the chain `train_loop` expects. After the allreduce every
  rank holds the same gradient, so all skip a non-finite step together. With
  ``config.shard_optimizer``: ``skip_nonfinite(shard_optimizer(comm, optimizer, ...),
  on="update")`` (the all-gathered update is the same on every rank). With
  ``config.double_buffering``: ``double_buffered_optimizer(skip_nonfinite(optimizer), comm,
  ...)``, ChainerMN's (the optimizer first runs at the second step).

  Example:
    >>> config = RunConfig(epochs=1, global_batch_size=8, workdir="runs/x")
    >>> tx = guarded_optimizer(optax.adam(1e-3), comm, config)
  """
  if config.shard_optimizer:
    sharded = shard_optimizer(comm, optimizer, wire_dtype=config.wire_dtype,
                              bucket_bytes=bucket_bytes_from_mb(config.bucket_mb))
    return skip_nonfinite(sharded, on="update")
  options = dict(wire_dtype=config.wire_dtype, bucket_bytes=bucket_bytes_from_mb(config.bucket_mb))
  if config.double_buffering:
    return double_buffered_optimizer(skip_nonfinite(optimizer), comm, **options)
  return optax.chain(allreduce_gradients(comm, **options), skip_nonfinite(optimizer))


def _flushed(state: TrainState, comm: Communicator, config: RunConfig) -> TrainState:
  """With double buffering, `state` with its pending gradient summed over the ranks
  (`mnjax.train.flush_pending`): what a checkpoint of rank 0 must hold. The run trains on
  with it, so a resumed run is bitwise the uninterrupted one."""
  if not config.double_buffering:
    return state
  return state.replace(opt_state=flush_pending(state.opt_state, comm))


def _skip_states(opt_state: Any) -> list[SkipNonFiniteState]:
  found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SkipNonFiniteState))
  return [s for s in found if isinstance(s, SkipNonFiniteState)]


def skipped_steps(opt_state: Any) -> int:
  """Steps `mnjax.skip_nonfinite` skipped so far, found by type anywhere in `opt_state`.

  Example:
    >>> tx = optax.chain(mnjax.skip_nonfinite(optax.sgd(0.1)))
    >>> skipped_steps(tx.init({"w": jnp.zeros(2)}))
    0
  """
  states = _skip_states(opt_state)
  if not states:
    raise ValueError("skipped_steps: the optimizer state holds no skip_nonfinite state; build"
                     " the optimizer with mnjax.train.guarded_optimizer (or wrap it in"
                     " mnjax.skip_nonfinite).")
  return sum(int(s.skipped) for s in states)


def _baseline_rate(workdir: str) -> float | None:
  """Images/s per rank in the last epoch of a 1-rank run of the same config."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not workdir or not os.path.exists(path):
    return None
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return records[-1]["images_per_second_per_rank"] if records else None


def _line(record: dict, compiled: bool) -> str:
  """Rank 0's line for an epoch's record."""
  r = record
  text = (f"epoch {r['epoch']:3d}  train loss {r['train_loss']:.4f} acc {r['train_accuracy']:.4f}"
          + (f"  test loss {r['test_loss']:.4f} acc {r['test_accuracy']:.4f}"
             if "test_accuracy" in r else "")
          + f"  {r['images_per_second']:,.0f} img/s ({r['images_per_second_per_rank']:,.0f}/rank)"
          f"  {r['epoch_seconds']:.1f} s  input wait {r['input_wait_share']:.1%}")
  if "parallel_efficiency" in r:
    text += f"  efficiency {r['parallel_efficiency']:.3f}"
  if r["skipped_steps"]:
    text += f"  {r['skipped_steps']} non-finite steps skipped"
  return text + ("  (includes compilation)" if compiled else "")


def _optimizer_values(opt_state: Any, rate: optax.ScalarOrSchedule | None, step: int) -> dict:
  """The rate of the last step (``step - 1``, as optax counts) and a dynamic loss scale."""
  values = {} if rate is None else {"learning_rate": float(rate(step - 1) if callable(rate)
                                                           else rate)}
  with contextlib.suppress(ValueError):  # none (or several) in the optimizer: not recorded
    values["loss_scale"] = float(loss_scale_state(opt_state).scale)
  return values


def _timeline_values(report: dict) -> dict:
  """An epoch record's fields from the timeline's straggler report (means over ranks)."""
  ranks = report["ranks"]
  return {"exchange_share": sum(r["exchange_share"] for r in ranks) / len(ranks),
          "wait_share": sum(r["wait_share"] for r in ranks) / len(ranks),
          "straggler_report": report}


def _evaluation(state: TrainState, eval_batches: Callable[[], Iterable] | None,
                comm: Communicator) -> dict:
  if eval_batches is None:
    return {}
  test = evaluate(state, eval_batches(), comm)
  return {"test_loss": test["loss"], "test_accuracy": test["correct"],
          "test_count": test["count"]}


def _epoch(config: RunConfig, comm: Communicator, state: TrainState, sums: Any, step: int, *,
           train_step: Callable, batches: Iterable, epoch: int, begin: int, steps: int,
           watchdog: Watchdog | None, checkpoints: Any, preemption: PreemptionSignals,
           profiler: StepProfiler, timeline: Timeline | None = None):
  """Steps ``begin .. steps - 1`` of `epoch` -> ``(state, sums, step, images, input wait,
  seconds)``; checkpoints every ``config.checkpoint_steps`` steps, and raises `Preempted`
  after a checkpoint when `preemption` reports a signal."""
  bar = tqdm(total=steps - begin, desc=f"epoch {epoch}", leave=False,
             disable=not (comm.is_root and config.progress))
  iterator = iter(batches)
  images, waited = 0, 0.0
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
      previous = state
      with profiler.before(step):
        state, metrics = train_step(state, batch[0], batch[1])
      if step % DIVERGENCE_CHECK_EVERY == 0:  # the previous step's counter: read meanwhile
        raise_if_diverging(previous.opt_state, config.max_consecutive_skips)
      sums = jax.tree.map(lambda a, b: a + b, sums, metrics)
      images += len(batch[1])
      step += 1
      profiler.after(step, state)
      bar.update()
      saved = bool(config.checkpoint_steps) and step % config.checkpoint_steps == 0
      if saved:
        state = _flushed(state, comm, config)
        checkpoints.save(step, state, sums, epoch, i + 1)
      signum = preemption.poll()
      if signum:
        if not saved:  # flushing twice would sum the pending gradients twice
          state = _flushed(state, comm, config)
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


def _holding_the_workdir(loop: Callable) -> Callable:
  """`loop` runs holding ``<config.workdir>/mnjax.lock``, taken before anything is written
  there (a second run in the directory stops on every rank) and released when it returns
  or raises."""
  @functools.wraps(loop)
  def holding(config: RunConfig, comm: Communicator, *args, **kwargs):
    with WorkdirLock(config.workdir, comm):
      return loop(config, comm, *args, **kwargs)
  return holding


@_holding_the_workdir
def train_loop(config: RunConfig, comm: Communicator, state: TrainState,
               train_step: Callable, batches: Callable[[int, int], Iterable], *,
               steps_per_epoch: int, eval_batches: Callable[[], Iterable] | None = None,
               header: str = "", learning_rate: optax.ScalarOrSchedule | None = None
               ) -> tuple[TrainState, dict]:
  """Trains `state` for ``config.epochs`` epochs (the rest of them with ``config.resume``).

  Collective: call on every rank with the same arguments. Holds the work directory while it
  runs (`mnjax.train.WorkdirLock`): a second run started in the same ``config.workdir``
  stops at once, on every rank, naming the run that holds it.

  Args:
    config: the run's settings (`RunConfig` or a subclass).
    comm: the `Communicator`.
    state: the initial state, identical on every rank (`mnjax.broadcast` it); its optimizer
      must hold a `mnjax.skip_nonfinite` (see `guarded_optimizer`).
    train_step: ``train_step(state, images, labels) -> (state, metric sums)``, as
      `mnjax.train.make_train_step` builds it.
    batches: ``batches(epoch, start)`` yields this process's batches of `epoch` from batch
      `start` on, each ``(images, labels, ...)``; the same order for the same epoch.
    steps_per_epoch: batches per epoch (``batches`` may yield more; they are not read).
    eval_batches: ``eval_batches()`` yields masked evaluation batches (`evaluate`) after
      each epoch; None: no evaluation.
    header: what rank 0 prints first, before the topology (model, dataset).
    learning_rate: the optimizer's rate (a number or an optax schedule of the step): each
      record holds its value at the epoch's last step; None: not recorded. A
      `mnjax.optim.dynamic_loss_scale` in the optimizer puts its scale in each record too.

  Returns:
    ``(state, the last epoch's record)`` (a finished run that was resumed: its evaluation).

  Example:
    >>> state, record = train_loop(config, comm, state, make_train_step(comm),
    ...                            lambda epoch, start: loader.epoch(epoch, start),
    ...                            steps_per_epoch=loader.steps())  # doctest: +SKIP
  """
  if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
    raise ValueError(f"train_loop: steps_per_epoch must be an int >= 1, got {steps_per_epoch!r}.")
  skipped_steps(state.opt_state)  # fails now, not after an epoch, without skip_nonfinite
  settings = {k: getattr(config, k) for k in config.resume_settings}
  for name in ("double_buffering", "shard_optimizer"):  # another optimizer state: refuse
    if getattr(config, name):  # a resume with the other setting, in those words
      settings[name] = True
  resume = config.resume or requeued()  # Slurm's requeue reruns the same command
  checkpoints = LoopCheckpoints(
      os.path.join(config.workdir, "checkpoints"), comm, resume=resume,
      keep=config.keep_checkpoints, settings=settings)
  try:
    state, sums, first_epoch, first_batch = checkpoints.start(state, zero_sums())
  except CheckpointTemplateError as error:  # the same on every rank
    if ".pending[" not in str(error):
      raise
    raise CheckpointTemplateError(
        f"{error}. The checkpoint and this run differ in --double_buffering (its pending"
        " gradient is part of the optimizer state): resume with the flag the run was saved"
        " with.") from error
  step = int(state.step)
  write_config(config.workdir, config, comm)
  log = MetricsLog(config.workdir, comm)
  if resume:  # records past the restored position are of work the checkpoint lost
    log.truncate_after(first_epoch - 1)
  baseline = _baseline_rate(config.baseline_workdir)
  if comm.is_root:
    print(f"mnjax: {header + ', ' if header else ''}{comm.summary}"
          f"{' (--comm auto)' if config.comm == 'auto' else ''},"
          f" global batch {config.global_batch_size}, {steps_per_epoch} steps/epoch"
          + (f"; resuming at epoch {first_epoch}, batch {first_batch} (step {step})"
             if step else ""), flush=True)

  record: dict = {}
  watchdog = Watchdog(comm, timeout=config.stall_timeout) if config.stall_timeout else None
  timeline = from_env(comm)  # MNJAX_TIMELINE: an unwritable path stops every rank here
  profiler = StepProfiler(profile_window(config.profile_steps, step),
                          os.path.join(config.workdir, "profile"), comm)
  with contextlib.ExitStack() as stack:
    stack.enter_context(checkpoints)  # leaving normally: waits for the last save, collective
    logdir = run_logdir(config.tensorboard, config.workdir)
    board = None if logdir is None else stack.enter_context(  # an unwritable one stops here
        TensorBoard(logdir, comm, purge_step=step if resume and step else None))
    stack.enter_context(profiler)
    if watchdog is not None:
      stack.enter_context(watchdog)
    if timeline is not None:
      stack.enter_context(timeline)  # rank 0 writes the trace when the run ends
    preemption = stack.enter_context(
        PreemptionSignals(comm, parse_signals(config.checkpoint_on_signal)))
    for epoch in range(first_epoch, config.epochs + 1):
      begin = min(first_batch if epoch == first_epoch else 0, steps_per_epoch)
      if timeline is not None:
        timeline.begin_epoch(epoch)
      state, sums, step, images, waited, seconds = _epoch(
          config, comm, state, sums, step, train_step=train_step, batches=batches(epoch, begin),
          epoch=epoch, begin=begin, steps=steps_per_epoch, watchdog=watchdog,
          checkpoints=checkpoints, preemption=preemption, profiler=profiler, timeline=timeline)
      stragglers = timeline.end_epoch(epoch) if timeline is not None else None  # collective
      check_replicas({"params": state.params, "batch_stats": state.batch_stats}, comm)
      train = global_mean(allreduce_metrics(sums, comm))
      per_rank = images / seconds
      record = {
          "epoch": epoch, "steps": step, "epoch_seconds": seconds,
          "train_loss": train["loss"], "train_accuracy": train["correct"],
          "images_per_second_per_rank": per_rank,
          "images_per_second": per_rank * comm.size,
          "input_wait_share": waited / seconds,
          "skipped_steps": skipped_steps(state.opt_state),
          **_optimizer_values(state.opt_state, learning_rate, step),
      }
      if baseline:
        record["parallel_efficiency"] = per_rank / baseline
      if stragglers is not None:  # rank 0, with MNJAX_TIMELINE: the epoch's straggler report
        record.update(_timeline_values(stragglers))
      record.update(_evaluation(state, eval_batches, comm))
      checkpoints.wait()  # a failed save ends the run on every rank before the next record
      log.write(**record)
      if board is not None:
        board.write(step, record)
      if comm.is_root:
        print(_line(record, compiled=epoch == first_epoch), flush=True)
      sums = zero_sums()
      if config.checkpoint_every and epoch % config.checkpoint_every == 0:
        state = _flushed(state, comm, config)
        checkpoints.save(step, state, sums, epoch + 1, 0)
    profiler.close(state)
  if comm.is_root and profiler.window:
    traced = profiler.steps
    print(f"mnjax: jax.profiler trace of global steps {traced[0]} .. {traced[-1]} in"
          f" {os.path.dirname(profiler.directory)}/rank<r> (tensorboard --logdir"
          f" {config.workdir})"
          if traced else f"mnjax: --profile_steps {config.profile_steps}: no step of global"
          f" steps {profiler.window[0]} .. {profiler.window[1] - 1} ran; nothing traced.",
          flush=True)
  if not record:  # resumed a finished run: report where it ended
    record = {"epoch": first_epoch - 1, "steps": step, **_evaluation(state, eval_batches, comm)}
  return state, record
