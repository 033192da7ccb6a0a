"""The multi-node model end to end, on 2 ranks (tests/jobs/test_multi_node_model.py):
ChainerMN's model-parallel MNIST shape (stages on ranks [0, 1, 0]) against the
single-process model, per-stage optimizers, a per-rank checkpoint resumed bitwise, and
GPipe micro-batching over stages on [0, 1]. Each rank writes WORKDIR/result-RANK.json
(a file, not stdout: two ranks' lines can interleave on a shared pipe).

    mpirun -n 2 python tests/support/multi_node_model_job.py WORKDIR
"""

import functools
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mnjax
import mnjax.functions
from mnjax.checkpoint import PerRankState
from mnjax.model_parallel import MultiNodeChain


class Hidden(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(self.width)(x))


class Head(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(self.width)(x)))


class Identity(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def max_error(mine, reference):
  """Largest difference between this rank's stages and the same stages of `reference`."""
  return max([float(jnp.max(jnp.abs(a - b))) for key in mine for a, b in
              zip(jax.tree.leaves(mine[key]), jax.tree.leaves(reference[key]))] or [0.0])


def same_bits(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(workdir):
  comm = mnjax.create_communicator()
  assert comm.size == 2, "run with mpirun -n 2"
  train = mnjax.data.load("digits", "train")
  x = jnp.asarray(train.images[:64].reshape(64, -1), jnp.float32)
  y = jnp.asarray(train.labels[:64])
  batches = [(jnp.asarray(train.images[i:i + 32].reshape(32, -1)), jnp.asarray(
      train.labels[i:i + 32])) for i in range(0, 32 * 6, 32)]
  result = {"rank": comm.rank}

  # 1. ChainerMN's MNIST split: Dense on rank 0 -> MLP on rank 1 -> output back on rank 0.
  chain = MultiNodeChain(comm, [(Hidden(32), 0), (Head(32), 1), (Identity(), 0)])
  params = chain.init(jax.random.key(0), x)
  every = chain.init_all(jax.random.key(0), x)
  result["stages"] = sorted(params)
  jit = functools.partial(mnjax.functions.jit, comm=comm)  # jax.jit + the pairing check
  loss, grads = jit(jax.value_and_grad(lambda p, x, y: chain.loss(p, x, y, cross_entropy)))(
      params, x, y)
  ref_loss, ref_grads = jax.value_and_grad(
      lambda p: cross_entropy(chain.apply_all(p, x), y))(every)
  result["grad_error"] = max_error(grads, ref_grads)
  result["loss_error"] = (abs(float(loss) - float(ref_loss))
                          if comm.rank == chain.output_rank else 0.0)

  # 2. Per-stage optimizers (SGD for stage 0, Adam for stage 1), 6 steps; a per-rank
  # checkpoint after 3, restored into a fresh template and trained on: bitwise the same.
  txs = [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2), optax.sgd(0.1)]
  tx = chain.optimizer(txs)

  @jit
  def step(params, opt_state, xb, yb):
    grads = jax.grad(chain.loss)(params, xb, yb, cross_entropy)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def run(params, opt_state, start, stop):
    for xb, yb in batches[start:stop]:
      params, opt_state = step(params, opt_state, xb, yb)
    return params, opt_state

  opt_state = tx.init(params)
  ckpt = mnjax.Checkpointer(f"{workdir}/ckpt", comm, async_save=False)
  params3, opt3 = run(params, opt_state, 0, 3)
  ckpt.save(3, {"stage": PerRankState({"params": params3, "opt": opt3}, comm), "step": 3})
  try:  # the same state without the wrapper: refused on every rank, naming the wrapper
    ckpt.save(4, {"params": params3})
    result["plain_save"] = "saved"
  except ValueError as error:
    result["plain_save"] = "refused" + (" naming PerRankState" if "PerRankState" in str(error)
                                        else f": {error}")
  params6, _ = run(params3, opt3, 3, 6)
  fresh = chain.init(jax.random.key(1), x)
  template = {"stage": PerRankState({"params": fresh, "opt": tx.init(fresh)}, comm), "step": 0}
  with mnjax.Checkpointer(f"{workdir}/ckpt", comm) as again:  # as a restarted job would
    at, back, _ = again.restore(template)
  result["restored_step"] = at
  result["restored_bitwise"] = same_bits(back["stage"].inner, {"params": params3, "opt": opt3})
  resumed, _ = run(back["stage"].inner["params"], back["stage"].inner["opt"], 3, 6)
  result["resumed_bitwise"] = same_bits(resumed, params6)
  ckpt.close()

  ref_tx = chain.optimizer(txs, every_stage=True)
  ref_state = ref_tx.init(every)
  for xb, yb in batches:
    g = jax.grad(lambda p, xb=xb, yb=yb: cross_entropy(chain.apply_all(p, xb), yb))(every)
    updates, ref_state = ref_tx.update(g, ref_state, every)
    every = optax.apply_updates(every, updates)
  result["trained_error"] = max_error(params6, every)

  # 3. GPipe: 4 micro-batches through stages on ranks [0, 1]; the gradient of the mean
  # loss is the whole batch's.
  stages = [(Hidden(32), 0), (Head(32), 1)]
  whole, piped = MultiNodeChain(comm, stages), MultiNodeChain(comm, stages, micro_batches=4)
  params = whole.init(jax.random.key(2), x)
  g1 = jit(jax.grad(lambda p, x, y: whole.loss(p, x, y, cross_entropy)))(params, x, y)
  g4 = jit(jax.grad(lambda p, x, y: piped.loss(p, x, y, cross_entropy)))(params, x, y)
  every = whole.init_all(jax.random.key(2), x)
  result["gpipe_error"] = max(max_error(g4, g1), max_error(
      g4, jax.grad(lambda p: cross_entropy(whole.apply_all(p, x), y))(every)))
  try:
    MultiNodeChain(comm, [(Hidden(32), 0), (Head(32), 1), (Identity(), 0)], micro_batches=2)
    result["cyclic_gpipe"] = "accepted"
  except mnjax.model_parallel.ScheduleError as error:
    result["cyclic_gpipe"] = "refused" if "deadlock" in str(error) else str(error)
  with open(f"{workdir}/result-{comm.rank}.json", "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1])
