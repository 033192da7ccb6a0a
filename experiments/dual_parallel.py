"""Data x model parallel MLP on the digits: ChainerMN's ``train_mnist_dual_parallel.py``.

    mpirun -n 4 python experiments/dual_parallel.py        # ~1 min on 2 CPU cores

Measured here (4 ranks, the defaults: 20 epochs, 280 steps of 100, Adam 1e-3): 95.5% test
accuracy, every stage within 3.3e-6 of the single-process MLP's parameters.

The ranks form a grid: ``model_axis = rank // 2`` picks a model group of two ranks (the
model communicator, ``comm.split(model_axis)``), ``data_axis = rank % 2`` the stage a rank
holds within it; the ranks that hold the same stage form a data communicator
(``comm.split(data_axis)``) over which that stage's gradients are averaged. As in
ChainerMN, the model is a `mnjax.model_parallel.MultiNodeChain` over the model
communicator: ``Dense + relu`` on model rank 0, ``Dense, relu, Dense`` on model rank 1, and
the output back on model rank 0 (ChainerMN's ``MLP0SubB``). Each model group trains on its
half of every global batch (the first half: model group 0); the ranks of model rank 1 read
no input. Any even number of ranks works (size / 2 data-parallel replicas of the chain).

At the end every rank compares its stages with the single-process model (the whole MLP,
Adam on the whole global batch, from the same initial parameters) and the job fails unless
they agree to ``--tolerance`` (1e-5).
"""

from __future__ import annotations

import _parallel_digits as common
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import mnjax
from mnjax.model_parallel import MultiNodeChain


class Input(nn.Module):
  """ChainerMN's ``MLP0SubA``: the first layer, on model rank 0."""
  units: int

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(self.units)(x))


class Middle(nn.Module):
  """ChainerMN's ``MLP1Sub``: the two other layers, on model rank 1."""
  units: int

  @nn.compact
  def __call__(self, h):
    return nn.Dense(10)(nn.relu(nn.Dense(self.units)(h)))


class Output(nn.Module):
  """ChainerMN's ``MLP0SubB``: the output, back on model rank 0."""

  @nn.compact
  def __call__(self, y):
    return y



def main(argv=None) -> None:
  p = common.parser(__doc__.splitlines()[0], epochs=20)
  p.add_argument("--units", type=int, default=100)
  args = p.parse_args(argv)
  comm = mnjax.create_communicator()
  if comm.size % 2:
    raise SystemExit(f"dual_parallel.py needs an even number of ranks (2 per model group),"
                     f" got {comm.size}: run it with mpirun -n 4.")
  data_axis, model_axis = comm.rank % 2, comm.rank // 2
  data_comm = comm.split(color=data_axis, key=comm.rank)    # the replicas of one stage
  model_comm = comm.split(color=model_axis, key=comm.rank)  # one whole model
  replicas = data_comm.size
  if args.batch_size % replicas:
    raise SystemExit(f"--batch_size {args.batch_size} must divide by the {replicas} replicas.")

  images, labels = common.digits("train", flat=True)
  test_images, test_labels = common.digits("test", flat=True)
  chain = MultiNodeChain(model_comm, [(Input(args.units), 0), (Middle(args.units), 1),
                                      (Output(), 0)])
  local = args.batch_size // replicas
  params = chain.init(jax.random.key(args.seed), images[:local])
  tx = optax.chain(mnjax.allreduce_gradients(data_comm), chain.optimizer(
      optax.adam(args.learning_rate)))
  opt_state = tx.init(params)

  # One plain jax.jit step: the model group's exchanges (over the model communicator,
  # paired by the check that runs when the step is lowered), then the update, whose
  # allreduce runs over the data communicator (checked by allreduce_gradients when traced).
  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(chain.loss)(params, x, y, common.cross_entropy)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # The single-process model: every stage, the whole global batch, from the same start.
  reference = chain.init_all(jax.random.key(args.seed), images[:local])
  ref_tx = chain.optimizer(optax.adam(args.learning_rate), every_stage=True)
  ref_state = ref_tx.init(reference)

  ref_step = common.reference_step(chain.apply_all, ref_tx)

  steps = 0
  for idx in common.batches(len(images), args):
    mine = idx[model_axis * local:(model_axis + 1) * local]  # this model group's half
    params, opt_state = step(params, opt_state, images[mine], labels[mine])
    reference, ref_state = ref_step(reference, ref_state, images[idx], labels[idx])
    steps += 1

  logits = jax.jit(chain.apply)(params, test_images)  # the model group's forward
  accuracy = float(jnp.mean(jnp.argmax(chain.apply_all(reference, test_images), -1)
                            == test_labels))
  if model_comm.rank == chain.output_rank:
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == test_labels))
  error = common.max_error([(a, b) for key in params for a, b in zip(
      jax.tree.leaves(params[key]), jax.tree.leaves(reference[key]))], comm)
  common.report(comm, "dual parallel MLP (data x model)", steps, error, accuracy,
                args.tolerance)


if __name__ == "__main__":
  main()
