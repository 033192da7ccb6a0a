"""The shared training loop (`lab.runner.train_loop`): epochs, exact metrics, checkpoints,
resume, a non-finite step skipped on every rank and counted wherever `skip_nonfinite` sits in
the optax chain, and arguments refused before the first step."""

import json

import jax
import numpy as np
import optax
import pytest

import lab.runner
import mnjax
from lab.models import SmallCNN
from lab.runner import (
  RunConfig,
  create_train_state,
  eval_batches,
  make_train_step,
  skipped_steps,
  train_loop,
)

DIGITS = mnjax.data.load_digits("train")
STEPS = 3


def config(comm, workdir, **overrides):
  return RunConfig(epochs=2, global_batch_size=8 * comm.size, workdir=str(workdir),
                   progress=False, **overrides)


def state_for(comm, tx):
  state = create_train_state(SmallCNN(), tx, DIGITS.images[:1], jax.random.key(0))
  return mnjax.broadcast(state, comm)


def batches_for(comm, poison=None):
  """``batches(epoch, start)`` over the digits; NaN images at global step `poison` (rank 0)."""
  def batches(epoch, start):
    order = list(mnjax.epoch_batches(len(DIGITS), comm, 8 * comm.size, shuffle=True,
                                     epoch=epoch))
    for i, (idx, _) in enumerate(order[start:STEPS], start=start):
      images = DIGITS.images[idx]
      if (epoch - 1) * STEPS + i == poison and comm.rank == 0:
        images = np.full_like(images, np.nan)
      yield images, DIGITS.labels[idx]
  return batches


def run(comm, workdir, tx, poison=None, **overrides):
  return train_loop(config(comm, workdir, **overrides), comm, state_for(comm, tx),
                    make_train_step(comm), batches_for(comm, poison), steps_per_epoch=STEPS,
                    eval_batches=lambda: eval_batches(DIGITS.images[:40], DIGITS.labels[:40],
                                                      comm, 8 * comm.size))


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_the_loop_trains_logs_checkpoints_and_skips_a_nan_step_anywhere_in_the_chain(
    comm, tmp_path):
  # skip_nonfinite at position 2 of the chain, not 1: the loop finds it by type.
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.clip(10.0),
                   mnjax.skip_nonfinite(optax.adam(1e-3)))
  state, record = run(comm, tmp_path, tx, poison=4)
  assert int(state.step) == 2 * STEPS
  assert record["epoch"] == 2 and record["steps"] == 2 * STEPS
  assert record["test_count"] == 40 and 0 <= record["test_accuracy"] <= 1
  assert record["skipped_steps"] == skipped_steps(state.opt_state) == 1  # on every rank
  assert record["images_per_second"] == pytest.approx(
      comm.size * record["images_per_second_per_rank"])
  mnjax.check_replicas(state.params, comm)
  if comm.is_root:
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2]
    assert [r["skipped_steps"] for r in lines] == [0, 1]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3, 6]
    assert json.loads((tmp_path / "config.json").read_text())["epochs"] == 2
  # Resumed when finished: no step runs, the record is the evaluation where it ended.
  again, final = run(comm, tmp_path, tx, resume=True)
  assert int(again.step) == 2 * STEPS and final["epoch"] == 2
  assert final["test_accuracy"] == record["test_accuracy"]


@pytest.mark.slow
def test_local_sgd_meets_at_every_epoch_end_and_resumes_bitwise(comm, tmp_path):
  """--local_sgd 2 over epochs of 3 steps: a meeting at step 2 and one forced at each epoch's
  end; identical replicas there, and a run resumed after epoch 1 equals the uninterrupted one
  bit for bit (each rank's inner optimizer state restored to it)."""
  def go(workdir, epochs, resume=False):
    cfg = RunConfig(epochs=epochs, global_batch_size=8 * comm.size, workdir=str(workdir),
                    progress=False, local_sgd=2, resume=resume)
    tx = lab.runner.guarded_optimizer(optax.adam(1e-2), comm, cfg)
    return train_loop(cfg, comm, state_for(comm, tx), make_train_step(comm), batches_for(comm),
                      steps_per_epoch=STEPS,
                      eval_batches=lambda: eval_batches(DIGITS.images[:40], DIGITS.labels[:40],
                                                        comm, 8 * comm.size))
  whole, _ = go(tmp_path / "whole", 2)
  mnjax.check_replicas(whole.params, comm)
  assert int(whole.opt_state.steps_left) == 2  # the epoch's end met
  go(tmp_path / "cut", 1)
  resumed, _ = go(tmp_path / "cut", 2, resume=True)
  jax.tree.map(np.testing.assert_array_equal, resumed.params, whole.params)
  jax.tree.map(np.testing.assert_array_equal, resumed.opt_state.inner_state,
               whole.opt_state.inner_state)
  with pytest.raises(ValueError, match="--local_sgd 2 cannot be combined with --checkpoint_steps"):
    RunConfig(epochs=1, global_batch_size=8, workdir=str(tmp_path), local_sgd=2,
              checkpoint_steps=5)


def test_the_loop_refuses_an_optimizer_without_skip_nonfinite(comm, tmp_path):
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))
  with pytest.raises(ValueError, match="holds no skip_nonfinite state"):
    run(comm, tmp_path, tx)
  assert not (tmp_path / "checkpoints").exists()


def test_the_loop_says_when_the_batches_run_out(comm, tmp_path):
  tx = lab.runner.guarded_optimizer(optax.adam(1e-3), comm, config(comm, tmp_path))
  with pytest.raises(ValueError, match=r"batches\(1, 0\) ended after 3 batches; steps_per_epoch"
                                       " is 4"):
    train_loop(config(comm, tmp_path, stall_timeout=0.0), comm, state_for(comm, tx),
               make_train_step(comm), batches_for(comm), steps_per_epoch=STEPS + 1)
