"""Model-parallel MLP on the digits: ChainerMN's ``train_mnist_model_parallel.py``.

    mpirun -n 2 python experiments/model_parallel_mnist.py     # ~30 s on 2 CPU cores
    mpirun -n 3 python experiments/model_parallel_mnist.py     # the MLP over three ranks

As in ChainerMN, rank 0 holds the input layer and the loss, and the rest of the model lives
on the other ranks: ``l1`` (64 -> units, relu) on rank 0; with 2 ranks ``l2`` (relu) and
``l3`` (-> 10) on rank 1, with 3 ranks ``l2`` on rank 1 and ``l3`` on rank 2; the logits go
back to rank 0 (ChainerMN's ``MLP0SubB``), which alone reads the data (the others have
ChainerMN's empty dataset). Written with `mnjax.functions` directly, inside each rank's own
step (`mnjax.functions.jit`): rank 0 ``send``s its activations and ``recv``s the logits,
joined to its loss by ``pseudo_connect``; rank ``k`` ``recv``s, applies its layers and
``send``s, its delegate being its loss. ``jax.grad`` then sends every gradient back the way
ChainerMN's backward does. Each rank runs Adam on its own layers.

At the end every rank compares its layers with the single-process model (the whole MLP,
Adam, the same batches, from the same initial parameters) and the job fails unless they
agree to ``--tolerance`` (1e-5); rank 0 prints the test accuracy.
"""

from __future__ import annotations

import _parallel_digits as common
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import mnjax
from mnjax import functions as F

#: The layers each rank holds, by number of ranks (rank 0 also computes the loss).
STAGES = {2: (("l1",), ("l2", "l3")), 3: (("l1",), ("l2",), ("l3",))}


class MLP(nn.Module):
  """ChainerMN's MLP: three dense layers, relu between them."""

  units: int

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(self.units, name="l1")(x))
    h = nn.relu(nn.Dense(self.units, name="l2")(h))
    return nn.Dense(10, name="l3")(h)


def layers(params, names, h):
  """`names` of the MLP applied to `h`, as the MLP applies them (relu after l1 and l2)."""
  for name in names:
    h = h @ params[name]["kernel"] + params[name]["bias"]
    if name != "l3":
      h = nn.relu(h)
  return h



def stage_steps(comm, names, units, batch, tx):
  """This rank's jitted train step and forward step (`mnjax.functions.jit`)."""
  rank, size = comm.rank, comm.size
  if rank == 0:
    logits_like = jax.ShapeDtypeStruct((batch, 10), jnp.float32)

    def forward(params, x):
      delegate = F.send(layers(params, names, x), comm, 1)
      return F.pseudo_connect(delegate, F.recv(comm, size - 1, logits_like))

    def loss(params, x, y):
      return common.cross_entropy(forward(params, x), y)

    def train(params, opt_state, x, y):
      value, grads = jax.value_and_grad(loss)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value
  else:
    like = jax.ShapeDtypeStruct((batch, units), jnp.float32)

    def forward(params):
      return F.send(layers(params, names, F.recv(comm, rank - 1, like)), comm, (rank + 1) % size)

    def train(params, opt_state):
      grads = jax.grad(forward)(params)  # the delegate is this rank's loss
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, jnp.zeros(())

  return F.jit(train, comm), F.jit(forward, comm)


def main(argv=None) -> None:
  p = common.parser(__doc__.splitlines()[0], epochs=5)
  p.add_argument("--units", type=int, default=100, help="hidden units (ChainerMN: 1000)")
  args = p.parse_args(argv)
  comm = mnjax.create_communicator("flat")
  if comm.size not in STAGES:
    raise SystemExit(f"model_parallel_mnist.py splits the MLP over 2 or 3 ranks, got"
                     f" {comm.size}: run it with mpirun -n 2 (or -n 3).")
  names = STAGES[comm.size][comm.rank]
  images, labels = common.digits("train", flat=True)
  test_images, test_labels = common.digits("test", flat=True)
  model = MLP(args.units)
  start = model.init(jax.random.key(args.seed), images[:1])["params"]  # the same everywhere
  tx = optax.adam(args.learning_rate)
  params = {name: start[name] for name in names}
  opt_state = tx.init(params)
  train, _ = stage_steps(comm, names, args.units, args.batch_size, tx)
  _, evaluate = stage_steps(comm, names, args.units, len(test_labels), tx)

  # The single-process model: the whole MLP, the same batches, from the same start.
  reference, ref_state = start, tx.init(start)

  ref_step = common.reference_step(lambda p, x: model.apply({"params": p}, x), tx)

  steps = 0
  for idx in common.batches(len(images), args):
    data = (images[idx], labels[idx]) if comm.rank == 0 else ()  # only rank 0 reads data
    params, opt_state, loss = train(params, opt_state, *data)
    reference, ref_state = ref_step(reference, ref_state, images[idx], labels[idx])
    steps += 1
    if comm.rank == 0 and steps % 50 == 0:
      print(f"step {steps}: loss {float(loss):.4f}", flush=True)

  logits = evaluate(params, test_images) if comm.rank == 0 else evaluate(params)
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == test_labels)) if comm.rank == 0 else 0.0
  error = common.max_error([(a, b) for name in names for a, b in zip(
      jax.tree.leaves(params[name]), jax.tree.leaves(reference[name]))], comm)
  common.report(comm, f"model-parallel MLP ({' | '.join('+'.join(s) for s in STAGES[comm.size])})",
                steps, error, accuracy, args.tolerance)


if __name__ == "__main__":
  main()
