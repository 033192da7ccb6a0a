"""A small CNN for 8x8 to 32x32 images (the digits experiment, tests and benchmarks)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class SmallCNN(nn.Module):
  """Two 3x3 convolutions, average pooling and a two-layer classifier head.

  About 150k parameters on 8x8 inputs: small enough for CPU tests, large enough that the
  gradient exchange is a real (600 kB) message.

  Example:
    >>> model = SmallCNN(num_classes=10)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    >>> model.apply({"params": params}, jnp.zeros((4, 8, 8, 1))).shape
    (4, 10)
  """

  num_classes: int = 10
  features: tuple[int, int] = (32, 64)
  hidden: int = 128

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    for f in self.features:
      x = nn.relu(nn.Conv(f, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)
