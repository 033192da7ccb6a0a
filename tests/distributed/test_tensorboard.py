"""TensorBoard scalars (`lab.runner.TensorBoard`): rank 0's event file holds the scalars
written, read back with TensorBoard's own reader (its EventAccumulator, no TensorFlow); a
resumed run's file hides what the earlier one logged past its start; a directory that
cannot be written stops the run on every rank before its first step; the records carry the
learning rate and a dynamic loss scale."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.events import read_scalars

from lab.runner import RunConfig, TensorBoard, TrainState, guarded_optimizer, train_loop
from lab.runner._records import optimizer_values
from mnjax.optim import dynamic_loss_scale


def test_the_event_file_holds_the_scalars_written_on_rank_0_only(comm, tmp_path):
  logdir = tmp_path / "tb"
  with TensorBoard(logdir, comm) as board:
    board.write(3, {"epoch": 1, "steps": 3, "train_loss": 0.5, "test_accuracy": 0.75,
                    "learning_rate": 1e-3, "skipped_steps": 0, "exchange_share": 0.25})
    board.write(6, {"epoch": 2, "steps": 6, "train_loss": 0.25, "test_accuracy": 0.875,
                    "learning_rate": 5e-4, "skipped_steps": 1, "exchange_share": 0.125})
  if comm.is_root:
    scalars = read_scalars(logdir)
    assert sorted(scalars) == ["optimizer/learning_rate", "optimizer/skipped_steps",
                               "test/accuracy", "throughput/exchange_share", "train/loss"]
    assert scalars["train/loss"] == [(3, 0.5), (6, 0.25)]
    assert scalars["test/accuracy"] == [(3, 0.75), (6, 0.875)]
    assert scalars["optimizer/skipped_steps"] == [(3, 0.0), (6, 1.0)]
    assert [step for step, _ in scalars["optimizer/learning_rate"]] == [3, 6]
    assert [v for _, v in scalars["optimizer/learning_rate"]] == pytest.approx([1e-3, 5e-4])
  else:
    assert not logdir.exists()  # rank 0 writes
  with pytest.raises(ValueError, match="is closed; build a new TensorBoard"):  # every rank
    board.write(9, {"train_loss": 1.0})
  # A run resumed at step 4: TensorBoard hides every event the first file has from step 4 on.
  with TensorBoard(logdir, comm, purge_step=4) as board:
    board.write(6, {"train_loss": 0.125})
  if comm.is_root:
    resumed = read_scalars(logdir)
    assert resumed["train/loss"] == [(3, 0.5), (6, 0.125)]
    assert resumed["test/accuracy"] == [(3, 0.75)]


def test_a_directory_that_cannot_be_written_fails_on_every_rank_before_the_first_step(
    comm, tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("not a directory")
  message = (r"could not write TensorBoard event files in '.*a-file/tb'.*Fix: pass"
             r" --tensorboard a directory .* \[failed on ranks \[0\] of")
  with pytest.raises(RuntimeError, match=message):
    TensorBoard(blocker / "tb", comm)
  # In the loop: before any step runs, and before metrics.jsonl gets a record.
  config = RunConfig(epochs=1, global_batch_size=8 * comm.size, workdir=str(tmp_path / "run"),
                     progress=False, stall_timeout=0.0, tensorboard=str(blocker / "tb"))
  state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)},
                            tx=guarded_optimizer(optax.sgd(0.1), comm, config))
  steps = []

  def train_step(state, images, labels):
    steps.append(len(labels))
    return state, {}

  with pytest.raises(RuntimeError, match=message):
    train_loop(config, comm, state, train_step,
               lambda epoch, start: iter([(np.zeros((8, 2)), np.zeros(8, np.int32))]),
               steps_per_epoch=1)
  assert steps == []
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_record_holds_the_learning_rate_of_the_last_step_and_the_loss_scale():
  params = {"w": jnp.zeros(2)}
  scaled = dynamic_loss_scale(optax.sgd(0.1)).init(params)
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
  assert optimizer_values(scaled, schedule, 3) == {"learning_rate": pytest.approx(0.8),
                                                    "loss_scale": 2.0**15}
  plain = optax.sgd(0.1).init(params)
  assert optimizer_values(plain, 0.5, 3) == {"learning_rate": 0.5}
  assert optimizer_values(plain, None, 3) == {}
