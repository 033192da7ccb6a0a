"""Data-parallel training: identical replicas, equivalence with large-batch training, exact eval."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from lab.models import SmallCNN
from lab.runner import create_train_state, eval_batches, eval_step, evaluate, train_step

DIGITS_TRAIN = mnjax.data.load_digits("train")
DIGITS_TEST = mnjax.data.load_digits("test")
LOCAL_BATCH = 4


def fingerprint(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


def relative_difference(a, b) -> float:
  """Largest per-leaf ||a - b|| / ||b|| over the tree."""
  diffs = jax.tree.map(
      lambda x, y: float(jnp.linalg.norm((x - y).ravel()) / jnp.linalg.norm(y.ravel())), a, b
  )
  return max(jax.tree.leaves(diffs))


def global_batch(step, size):
  """The examples of global step `step`: p*b consecutive examples of the train split."""
  start = step * LOCAL_BATCH * size
  idx = np.arange(start, start + LOCAL_BATCH * size) % len(DIGITS_TRAIN)
  return DIGITS_TRAIN.images[idx], DIGITS_TRAIN.labels[idx]


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_params_bitwise_identical_on_every_rank_after_training(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))
  # Different seeds on purpose: broadcast must make the start identical.
  state = create_train_state(SmallCNN(), tx, DIGITS_TRAIN.images[:1], jax.random.key(comm.rank))
  state = mnjax.broadcast(state, comm)
  grads_differ = []
  for idx, _ in mnjax.epoch_batches(len(DIGITS_TRAIN), comm, 16 * comm.size, shuffle=True):
    state, metrics = train_step(state, DIGITS_TRAIN.images[idx], DIGITS_TRAIN.labels[idx])
    grads_differ.append(float(metrics["loss_sum"]))
    if len(grads_differ) == 12:
      break
  fingerprints = comm.mpi_comm.allgather(fingerprint(state.params))
  assert len(set(fingerprints)) == 1, fingerprints
  assert int(state.step) == 12
  # Non-vacuous: the ranks really trained on different data.
  losses = comm.mpi_comm.allgather(grads_differ)
  assert len({tuple(rank_losses) for rank_losses in losses}) == comm.size


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_data_parallel_sgd_equals_single_process_large_batch_sgd(comm):
  def make(tx):
    return create_train_state(SmallCNN(), tx, DIGITS_TRAIN.images[:1], jax.random.key(0))

  opt = optax.sgd(0.1, momentum=0.9)
  parallel = make(optax.chain(mnjax.allreduce_gradients(comm), opt))
  reference = make(opt)  # every rank also runs the single-process, global-batch run
  for step in range(10):
    images, labels = global_batch(step, comm.size)
    mine = slice(comm.rank * LOCAL_BATCH, (comm.rank + 1) * LOCAL_BATCH)
    parallel, _ = train_step(parallel, images[mine], labels[mine])
    reference, _ = train_step(reference, images, labels)
  moved = relative_difference(reference.params, make(opt).params)
  assert moved > 1e-3  # training changed the parameters
  assert relative_difference(parallel.params, reference.params) <= 1e-5


def test_global_evaluation_equals_single_process_evaluation(comm):
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(3e-3))
  state = create_train_state(SmallCNN(), tx, DIGITS_TRAIN.images[:1], jax.random.key(0))
  for step in range(15):  # partly trained, so accuracy is neither ~0.1 nor ~1
    images, labels = global_batch(step, comm.size)
    mine = slice(comm.rank * LOCAL_BATCH, (comm.rank + 1) * LOCAL_BATCH)
    state, _ = train_step(state, images[mine], labels[mine])
  n = len(DIGITS_TEST)
  # 359 examples, batch 16 * size: padded last batches and equal-length duplicates.
  sharded = evaluate(state, eval_batches(DIGITS_TEST.images, DIGITS_TEST.labels, comm,
                                         16 * comm.size), comm)
  whole = eval_step(state, DIGITS_TEST.images, DIGITS_TEST.labels, np.ones(n, bool))
  assert sharded["count"] == n
  assert sharded["correct"] == int(whole["correct"]) / n
  assert abs(sharded["loss"] - float(whole["loss_sum"]) / n) <= 1e-5 * sharded["loss"]
  assert 0.2 < sharded["correct"] < 1.0


def test_pmean_style_metrics_of_uneven_shards_equal_single_process_evaluation(comm):
  # A step ported from flax reports means (its pmean removed); ranks hold different numbers
  # of examples (np.array_split of 359); mean_metrics weighted by them is the whole split's.
  state = create_train_state(SmallCNN(), optax.sgd(0.1), DIGITS_TRAIN.images[:1],
                             jax.random.key(0))
  mine = np.array_split(np.arange(len(DIGITS_TEST)), comm.size)[comm.rank]
  sums = eval_step(state, DIGITS_TEST.images[mine], DIGITS_TEST.labels[mine],
                   np.ones(len(mine), bool))
  means = {"loss": sums["loss_sum"] / sums["count"], "accuracy": sums["correct"] / sums["count"],
           "lr": np.float32(0.1)}
  out = mnjax.mean_metrics(means, comm, weight=len(mine))
  n = len(DIGITS_TEST)
  whole = eval_step(state, DIGITS_TEST.images, DIGITS_TEST.labels, np.ones(n, bool))
  assert out["accuracy"] == pytest.approx(int(whole["correct"]) / n, rel=1e-6)
  assert out["loss"] == pytest.approx(float(whole["loss_sum"]) / n, rel=1e-5)
  assert out["lr"] == float(np.float32(0.1))  # the same on every rank: passed through
