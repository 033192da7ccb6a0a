"""What the model-parallel ports share: the digits as float batches in a fixed order, the
loss, the single-process reference step, and the check that the ranks' parameters equal the
single-process model's.

Used by ``model_parallel_mnist.py``, ``dual_parallel.py`` and ``channel_parallel.py`` (not a
script).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import mnjax


def parser(description: str, **defaults) -> argparse.ArgumentParser:
  """The ports' flags: steps, batch size, learning rate, seed, tolerance."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--epochs", type=int, default=defaults.get("epochs", 2))
  p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all)")
  p.add_argument("--batch_size", type=int, default=defaults.get("batch_size", 100),
                 help="the global batch")
  p.add_argument("--learning_rate", type=float, default=defaults.get("learning_rate", 1e-3))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tolerance", type=float, default=1e-5,
                 help="largest |parameter - single-process parameter| accepted")
  return p


def digits(split: str, *, flat: bool) -> tuple[np.ndarray, np.ndarray]:
  """Images in [0, 1] as `mnjax.data.load` gives them (flattened to 64, or 8x8x1), labels."""
  data = mnjax.data.load("digits", split)
  images = np.asarray(data.images, np.float32)
  return (images.reshape(len(images), -1) if flat else images), np.asarray(data.labels)


def batches(n: int, args: argparse.Namespace) -> Iterator[np.ndarray]:
  """Global batches of example indices: a fresh permutation per epoch, ``--steps`` at most."""
  taken = 0
  for epoch in range(args.epochs):
    order = np.random.default_rng([args.seed, epoch]).permutation(n)
    for start in range(0, n - args.batch_size + 1, args.batch_size):
      if args.steps and taken == args.steps:
        return
      taken += 1
      yield order[start:start + args.batch_size]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The mean softmax cross-entropy over integer labels."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def reference_step(forward: Callable[[Any, jax.Array], jax.Array],
                   tx: optax.GradientTransformation) -> Callable[..., tuple[Any, Any]]:
  """The single-process model's jitted SGD step, ``(params, opt_state, x, y) -> (params,
  opt_state)``, for ``forward(params, x) -> logits``: what each port is compared with."""
  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: cross_entropy(forward(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def max_error(pairs: list[tuple[jax.Array, jax.Array]], comm: mnjax.Communicator) -> float:
  """The largest ``|a - b|`` over `pairs` on every rank (a host allreduce)."""
  mine = max([float(jnp.max(jnp.abs(a - b))) for a, b in pairs] or [0.0])
  return comm.mpi_comm.allreduce(mine, op=MPI.MAX) if comm.size > 1 else mine


def report(comm: mnjax.Communicator, what: str, steps: int, error: float, accuracy: float,
           tolerance: float) -> None:
  """Prints the outcome on rank 0; exits 1 on every rank when `error` exceeds `tolerance`."""
  if comm.is_root:
    print(f"{what}: {steps} steps on {comm.size} ranks; test accuracy {accuracy:.4f};"
          f" max |params - single-process params| = {error:.3g} (tolerance {tolerance:g})",
          flush=True)
  if not error <= tolerance:
    raise SystemExit(1)
