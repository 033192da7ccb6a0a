"""Channel-parallel CNN on the digits: ChainerMN's ``examples/chainermn/parallel_convolution``.

    mpirun -n 2 python experiments/channel_parallel.py     # ~1 min on 2 CPU cores

Measured here (2 ranks, the defaults: 2 epochs, 44 steps of 64): 94.4% test accuracy,
parameters within 1.8e-7 of the single-process CNN's. The trajectories stay that close for
about 60 steps, then part (1.8e-5 after 66 steps, 1.4e-3 after 120): the slice
convolutions round differently from the whole one (~1e-7), and at momentum SGD's 0.05 such
differences grow once, say, a ReLU input near zero changes sign. Longer runs train as well
(97.5% after 10 epochs) but not to the same parameters.

Each convolution is a `mnjax.model_parallel.ChannelParallelConv`: every rank holds the
kernel of ``features // comm.size`` output channels, convolves the whole input with them,
and an in-step allgather (`mnjax.functions.allgather`) gives every rank the whole
activation; the dense head is replicated (every rank holds and updates the same one). Every
rank reads the same batch (ChainerMN's multi-node iterator). The allgather's backward sums
every rank's cotangent of a slice, ``comm.size`` times the slice's gradient when every rank
computes the same loss: `slice_grads` divides it back, so that the model trains to the
single-process parameters (ChainerMN's example leaves the factor in). The optimizer is
the example's: momentum SGD (0.05, momentum 0.9) with weight decay 5e-4.

At the end every rank compares its slices and the head with the single-process CNN (plain
``nn.Conv``, whose initial kernels are the ranks' slices joined, the same optimizer and
batches)
and the job fails unless they agree to ``--tolerance`` (1e-5). Ranks: any number that
divides the channel counts (8 and 16).
"""

from __future__ import annotations

import _parallel_digits as common
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import mnjax
import mnjax.functions
from mnjax.model_parallel import ChannelParallelConv, join_slices, slice_grads

FEATURES = (8, 16)


class CNN(nn.Module):
  """Two 3x3 convolutions (channel-parallel when `comm` is given), then a dense head."""
  comm: mnjax.Communicator | None = None

  @nn.compact
  def __call__(self, x):
    for i, features in enumerate(FEATURES):
      conv = (nn.Conv(features, (3, 3), name=f"conv{i}") if self.comm is None else
              ChannelParallelConv(self.comm, features, (3, 3), name=f"conv{i}"))
      x = nn.relu(conv(x))
    return nn.Dense(10, name="head")(x.reshape(len(x), -1))



def main(argv=None) -> None:
  args = common.parser(__doc__.splitlines()[0], epochs=2, batch_size=64,
                       learning_rate=0.05).parse_args(argv)
  comm = mnjax.create_communicator()
  images, labels = common.digits("train", flat=False)
  test_images, test_labels = common.digits("test", flat=False)

  model = CNN(comm)
  params = model.init(jax.random.key(args.seed), images[:1])["params"]
  # The same head everywhere (rank 0's); each rank's own slices.
  params = {**params, "head": mnjax.broadcast(params["head"], comm, root=0)}
  # ChainerMN's example: MomentumSGD(0.05) with weight decay 5e-4.
  tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(args.learning_rate, momentum=0.9))
  opt_state = tx.init(params)

  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: common.cross_entropy(model.apply({"params": p}, x), y))(params)
    grads = {k: g if k == "head" else slice_grads(g, comm) for k, g in grads.items()}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = mnjax.functions.jit(step, comm)

  # The single-process CNN, from the ranks' slices joined.
  every = comm.mpi_comm.allgather(jax.device_get(params)) if comm.size > 1 else [params]
  reference = {**{f"conv{i}": join_slices([p[f"conv{i}"] for p in every])
                  for i in range(len(FEATURES))}, "head": params["head"]}
  plain = CNN()
  ref_state = tx.init(reference)

  ref_step = common.reference_step(lambda p, x: plain.apply({"params": p}, x), tx)

  steps = 0
  for idx in common.batches(len(images), args):
    params, opt_state = step(params, opt_state, images[idx], labels[idx])
    reference, ref_state = ref_step(reference, ref_state, images[idx], labels[idx])
    steps += 1

  logits = mnjax.functions.jit(lambda p, x: model.apply({"params": p}, x), comm)(
      params, test_images)
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == test_labels))
  width = {f"conv{i}": f // comm.size for i, f in enumerate(FEATURES)}
  pairs = [(a, b) for a, b in zip(jax.tree.leaves(params["head"]),
                                  jax.tree.leaves(reference["head"]))]
  for name, w in width.items():  # this rank's slice of the joined kernel and bias
    for leaf in ("kernel", "bias"):
      mine = params[name]["slice"][leaf]
      pairs.append((mine, reference[name][leaf][..., comm.rank * w:(comm.rank + 1) * w]))
  error = common.max_error(pairs, comm)
  common.report(comm, "channel-parallel CNN", steps, error, accuracy, args.tolerance)


if __name__ == "__main__":
  main()
