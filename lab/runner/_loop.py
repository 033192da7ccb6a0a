"""The guarded training loop every experiment runs.

`train_loop` runs epochs of a train step over an experiment's batches and owns everything
around the step that must not differ between experiments: resuming from the newest
checkpoint (`mnjax.checkpoint.LoopCheckpoints`, bit for bit, mid-epoch too), the stall watchdog, the
divergence check on `mnjax.skip_nonfinite`'s counters, the replica comparison after every
epoch, exact global metrics, the JSON-lines log, the progress bar, checkpoints every
``checkpoint_steps`` steps and every ``checkpoint_every`` epochs (a save that fails stops
the run on every rank before the next epoch is recorded, and a resumed run cuts
``metrics.jsonl`` back to the checkpoint it resumes from). An experiment builds its
data, model and optimizer and hands over three things: the step, the batches of an epoch
and, optionally, the evaluation batches.

Its pieces: the settings (`RunConfig`, `lab.runner._run_config`), the optimizer it expects
(`guarded_optimizer`, `skipped_steps`: `lab.runner._guarded_optimizer`), one epoch's steps
(`lab.runner._epoch`) and each epoch's record (`lab.runner._records`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable

import optax

from lab.runner._classifier import TrainState, zero_sums
from lab.runner._epoch import flushed, run_epoch
from lab.runner._guarded_optimizer import guarded_optimizer, skipped_steps
from lab.runner._lock import WorkdirLock
from lab.runner._preemption import PreemptionSignals, parse_signals, requeued
from lab.runner._profile import StepProfiler, profile_window
from lab.runner._records import (
  baseline_rate,
  epoch_line,
  evaluation,
  optimizer_values,
  timeline_values,
)
from lab.runner._run_config import RunConfig
from lab.runner._tensorboard import TensorBoard, run_logdir
from lab.runner._workdir import MetricsLog, write_config
from mnjax.checkpoint._loop import LoopCheckpoints
from mnjax.comm._communicator import Communicator
from mnjax.guard._consensus import check_replicas
from mnjax.guard._timeline import from_env
from mnjax.guard._watchdog import Watchdog
from mnjax.train._metrics import allreduce_metrics, global_mean

__all__ = ["RunConfig", "guarded_optimizer", "skipped_steps", "train_loop"]


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
  runs (`lab.runner.WorkdirLock`): a second run started in the same ``config.workdir``
  stops at once, on every rank, naming the run that holds it.

  Args:
    config: the run's settings (`RunConfig` or a subclass).
    comm: the `Communicator`.
    state: the initial state, identical on every rank (`mnjax.broadcast` it); its optimizer
      must hold a `mnjax.skip_nonfinite` (see `guarded_optimizer`).
    train_step: ``train_step(state, images, labels) -> (state, metric sums)``, as
      `lab.runner.make_train_step` builds it.
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
  for name in ("double_buffering", "shard_optimizer"):  # another optimizer state: a resume
    settings[name] = bool(getattr(config, name))      # with the other setting is named
  if config.local_sgd:  # each replica's own optimizer state: it resumes on as many ranks
    settings["local_sgd"] = config.local_sgd
    settings["local_sgd_ranks"] = comm.size
  settings["replicas"] = config.replicas  # exact sums of another count: other bits
  resume = config.resume or requeued()  # Slurm's requeue reruns the same command
  checkpoints = LoopCheckpoints(
      os.path.join(config.workdir, "checkpoints"), comm, resume=resume,
      keep=config.keep_checkpoints, settings=settings, per_replica=comm.exact)
  state, sums, first_epoch, first_batch = checkpoints.start(state, zero_sums(comm))
  step = int(state.step)
  write_config(config.workdir, config, comm)
  log = MetricsLog(config.workdir, comm)
  if resume:  # records past the restored position are of work the checkpoint lost
    log.truncate_after(first_epoch - 1)
  baseline = baseline_rate(config.baseline_workdir)
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
      state, sums, step, images, waited, seconds = run_epoch(
          config, comm, state, sums, step, train_step=train_step, batches=batches(epoch, begin),
          epoch=epoch, begin=begin, steps=steps_per_epoch, watchdog=watchdog,
          checkpoints=checkpoints, preemption=preemption, profiler=profiler, timeline=timeline)
      stragglers = timeline.end_epoch(epoch) if timeline is not None else None  # collective
      check_replicas({"params": state.params, "batch_stats": state.batch_stats}, comm)
      train = global_mean(allreduce_metrics(sums, comm, per_replica=comm.exact))
      per_rank = images / seconds
      record = {
          "epoch": epoch, "steps": step, "epoch_seconds": seconds,
          "train_loss": train["loss"], "train_accuracy": train["correct"],
          "images_per_second_per_rank": per_rank,
          "images_per_second": per_rank * comm.size,
          "input_wait_share": waited / seconds,
          "skipped_steps": skipped_steps(state.opt_state),
          **optimizer_values(state.opt_state, learning_rate, step),
      }
      if baseline:
        record["parallel_efficiency"] = per_rank / baseline
      if stragglers is not None:  # rank 0, with MNJAX_TIMELINE: the epoch's straggler report
        record.update(timeline_values(stragglers))
      record.update(evaluation(state, eval_batches, comm))
      checkpoints.wait()  # a failed save ends the run on every rank before the next record
      log.write(**record)
      if board is not None:
        board.write(step, record)
      if comm.is_root:
        print(epoch_line(record, compiled=epoch == first_epoch), flush=True)
      sums = zero_sums(comm)
      if config.checkpoint_every and epoch % config.checkpoint_every == 0:
        state = flushed(state, comm, config)
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
    record = {"epoch": first_epoch - 1, "steps": step, **evaluation(state, eval_batches, comm)}
  return state, record
