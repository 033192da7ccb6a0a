"""TensorBoard scalars of a run: each epoch's record of ``metrics.jsonl``, written by rank 0.

``metrics.jsonl`` is what tests and scripts read; people look at curves. `TensorBoard` writes
the same numbers as TensorBoard scalars with tensorboardX's event file writer and summary
protos (numpy and protobuf only, no TensorFlow), at the global step the epoch ended on,
grouped by `scalar_tags` (``train/loss``, ``test/accuracy``,
``throughput/images_per_second``, ``optimizer/learning_rate``...); a field it does not know
(a metric added to the record later) still appears, under ``other/``.

Like every work-directory write (`lab.runner._lock.on_root`), opening the event file and
each write are collective: a directory that cannot be written is the same `RuntimeError` on
every rank when the writer is built, before the first step, not a lost file at the end.
Writes are synchronous and flushed (a few records per epoch): tensorboardX's
``SummaryWriter`` queues them for a thread instead, whose failure (a full disk) would be
seen by no rank and would block rank 0 once its queue filled.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Mapping
from typing import Any

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import directory_check
from tensorboardX.summary import scalar

from lab.runner._lock import on_root
from mnjax.comm._communicator import Communicator, check_communicator

__all__ = ["TensorBoard", "run_logdir", "scalar_tags"]

# The epoch record's fields (`lab.runner.train_loop`) and their TensorBoard tags.
TAGS = {
    "train_loss": "train/loss",
    "train_accuracy": "train/accuracy",
    "test_loss": "test/loss",
    "test_accuracy": "test/accuracy",
    "images_per_second": "throughput/images_per_second",
    "images_per_second_per_rank": "throughput/images_per_second_per_rank",
    "epoch_seconds": "throughput/epoch_seconds",
    "input_wait_share": "throughput/input_wait_share",
    "parallel_efficiency": "throughput/parallel_efficiency",
    "exchange_share": "throughput/exchange_share",  # with MNJAX_TIMELINE (mnjax.guard.Timeline)
    "wait_share": "throughput/wait_share",
    "learning_rate": "optimizer/learning_rate",
    "skipped_steps": "optimizer/skipped_steps",
    "loss_scale": "optimizer/loss_scale",
}
# Positions and sizes, not curves.
NOT_SCALARS = frozenset({"epoch", "steps", "time", "test_count"})


def scalar_tags(record: Mapping[str, Any]) -> dict[str, float]:
  """The TensorBoard scalars of an epoch record: every real number in it but the position
  (``epoch``, ``steps``), the wall time and the test count, under its tag (`TAGS`; an
  unknown field ``x`` as ``other/x``).

  Example:
    >>> scalar_tags({"epoch": 2, "steps": 40, "train_loss": 0.25, "learning_rate": 1e-3,
    ...              "exchange_share": 0.125, "note": "text"})
    {'train/loss': 0.25, 'optimizer/learning_rate': 0.001, 'throughput/exchange_share': 0.125}
  """
  out = {}
  for key, value in record.items():
    if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, numbers.Real):
      continue
    out[TAGS.get(key, f"other/{key}")] = float(value)
  return out


def run_logdir(tensorboard: str, workdir: str) -> str | None:
  """The directory of a run's ``--tensorboard`` flag: ``auto`` is ``<workdir>/tensorboard``,
  ``''`` none (None), anything else that path.

  Example:
    >>> run_logdir("auto", "runs/x"), run_logdir("", "runs/x"), run_logdir("/tmp/tb", "runs/x")
    ('runs/x/tensorboard', None, '/tmp/tb')
  """
  if not tensorboard:
    return None
  return os.path.join(workdir, "tensorboard") if tensorboard == "auto" else tensorboard


def _open(logdir: str, purge_step: int | None) -> EventsWriter:
  """A new event file in `logdir`; with `purge_step`, TensorBoard hides earlier events from
  that step on (what tensorboardX's ``SummaryWriter(purge_step=...)`` writes)."""
  try:
    directory_check(logdir)  # os.makedirs, or nothing for gs:// and s3:// paths
    # events.out.tfevents.<seconds>.<host> + the nanoseconds: a later file sorts later (what
    # TensorBoard reads in order), and a writer opened in the same second overwrites none.
    writer = EventsWriter(os.path.join(logdir, "events"), f".{time.time_ns() % 10**9:09d}")
    if purge_step is not None:
      writer.write_event(event_pb2.Event(
          step=purge_step, wall_time=time.time(),
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    writer.flush()
    return writer
  except OSError as error:
    raise RuntimeError(
        f"mnjax: could not write TensorBoard event files in {logdir!r}:"
        f" {error.strerror or error} ({error.filename or logdir}). Fix: pass --tensorboard a"
        " directory this process may create and write (its parents must be directories),"
        " or --tensorboard '' to write none.") from error


def _write(writer: EventsWriter, step: int, scalars: Mapping[str, float]) -> None:
  now = time.time()
  for tag, value in scalars.items():
    writer.write_event(event_pb2.Event(step=step, wall_time=now, summary=scalar(tag, value)))
  writer.flush()


class TensorBoard:
  """TensorBoard scalars in `logdir`, written by rank 0; building it and `write` are
  collective (call them on every rank).

  Building it opens a new event file on rank 0 (creating `logdir`); `write` appends and
  flushes to disk. A failure of either raises the same `RuntimeError` on every rank, so a
  directory that cannot be written stops the run before its first step. `purge_step`: a
  resumed run's first step, so that TensorBoard hides what an earlier attempt logged from
  there on. Use it as a context manager, or `close` it.

  Example:
    >>> with TensorBoard("runs/x/tensorboard", comm) as board:
    ...   board.write(10, {"train_loss": 0.5, "train_accuracy": 0.875})
  """

  def __init__(self, logdir: str | os.PathLike, comm: Communicator, *,
               purge_step: int | None = None):
    check_communicator(comm, "TensorBoard")
    self.logdir = os.fspath(logdir)
    self._comm = comm
    self._closed = False
    self._writer = on_root(comm, self.logdir, "write TensorBoard event files in", _open,
                           self.logdir, purge_step)

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    """Adds the scalars of `record` (`scalar_tags`) at global step `step`; collective."""
    if self._closed:
      raise ValueError(f"TensorBoard.write: the writer of {self.logdir!r} is closed; build a"
                       " new TensorBoard to write more.")
    on_root(self._comm, self.logdir, "write TensorBoard event files in", _write, self._writer,
            int(step), scalar_tags(record))

  def close(self) -> None:
    """Closes the event file (rank 0; not collective); later writes are refused."""
    self._closed = True
    writer, self._writer = self._writer, None
    if writer is not None:
      writer.close()

  def __enter__(self) -> TensorBoard:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
