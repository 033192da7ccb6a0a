"""ResNet-18/34/50/101/152 in flax linen, with ImageNet and CIFAR stems.

The architecture of He et al. (2016) as in torchvision's reference (so parameter counts
match: ResNet-50 25,557,032, ResNet-18 11,689,512 with 1000 classes), with two choices the
large-minibatch papers rely on:

* ``norm``: the normalisation layer, flax's ``nn.BatchNorm`` by default; pass a
  synchronized batch norm to normalise over the global batch.
* ``zero_init_residual``: the last BN scale of each residual block starts at zero (Goyal et
  al. 2017, section 5.1), so every block starts as the identity.

The CIFAR stem (``stem="cifar"``) is one 3x3 stride-1 convolution without max pooling, for
32x32 inputs.

    model = ResNet50(num_classes=1000)
    variables = model.init(key, images, train=False)
    logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "ResNet6", "ResNet10", "ResNet18", "ResNet34",
           "ResNet50", "ResNet101", "ResNet152"]

STEMS = ("imagenet", "cifar")


class BasicBlock(nn.Module):
  """Two 3x3 convolutions (ResNet-18/34)."""

  filters: int
  strides: int
  norm: Callable[..., nn.Module]
  zero_init_residual: bool
  expansion = 1

  @nn.compact
  def __call__(self, x):
    residual = x
    y = nn.Conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(x)
    y = nn.relu(self.norm()(y))
    y = nn.Conv(self.filters, (3, 3), padding=1, use_bias=False)(y)
    y = self.norm(scale_init=_last_scale_init(self.zero_init_residual))(y)
    return nn.relu(y + _shortcut(residual, y.shape[-1], self.strides, self.norm))


class Bottleneck(nn.Module):
  """1x1 reduce, 3x3 (carrying the stride, as torchvision's v1.5), 1x1 expand (ResNet-50+)."""

  filters: int
  strides: int
  norm: Callable[..., nn.Module]
  zero_init_residual: bool
  expansion = 4

  @nn.compact
  def __call__(self, x):
    residual = x
    y = nn.relu(self.norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(y)
    y = nn.relu(self.norm()(y))
    y = nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y)
    y = self.norm(scale_init=_last_scale_init(self.zero_init_residual))(y)
    return nn.relu(y + _shortcut(residual, y.shape[-1], self.strides, self.norm))


def _last_scale_init(zero: bool):
  return nn.initializers.zeros if zero else nn.initializers.ones


def _shortcut(x, features: int, strides: int, norm):
  """Identity, or a 1x1 projection + norm where the shape changes."""
  if x.shape[-1] == features and strides == 1:
    return x
  x = nn.Conv(features, (1, 1), strides, use_bias=False, name="projection")(x)
  return norm(name="projection_norm")(x)


class ResNet(nn.Module):
  """A ResNet: stem, four stages of residual blocks, global average pool, dense classifier.

  Attributes:
    stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet-50.
    block: `BasicBlock` or `Bottleneck`.
    num_classes: classifier outputs.
    stem: ``"imagenet"`` (7x7/2 conv + 3x3/2 max pool) or ``"cifar"`` (3x3/1 conv).
    norm: normalisation layer factory taking flax BatchNorm's arguments.
    zero_init_residual: start each block's last norm scale at zero.
    bn_momentum: decay of the running statistics (0.0: keep the last batch's, Akiba et al.).
    dtype: computation dtype (parameters stay float32).

  Example:
    >>> model = ResNet18(num_classes=10, stem="cifar")
    >>> x = jnp.zeros((1, 32, 32, 3))
    >>> shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    >>> sorted(shapes), sum(p.size for p in jax.tree.leaves(shapes["params"]))
    (['batch_stats', 'params'], 11173962)
    >>> variables = model.init(jax.random.key(0), x, train=False)  # doctest: +SKIP
    >>> logits, new = model.apply(  # doctest: +SKIP
    ...     variables, images, train=True, mutable=["batch_stats"])
  """

  stage_sizes: Sequence[int]
  block: type
  num_classes: int = 1000
  stem: str = "imagenet"
  norm: Callable[..., nn.Module] = nn.BatchNorm
  zero_init_residual: bool = True
  bn_momentum: float = 0.9
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    if self.stem not in STEMS:
      raise ValueError(f"ResNet: stem must be one of {STEMS}, got {self.stem!r}.")
    norm = functools.partial(self.norm, use_running_average=not train, momentum=self.bn_momentum,
                             epsilon=1e-5, dtype=self.dtype)
    x = x.astype(self.dtype)
    if self.stem == "imagenet":
      x = nn.Conv(64, (7, 7), 2, padding=3, use_bias=False, dtype=self.dtype, name="stem")(x)
      x = nn.relu(norm(name="stem_norm")(x))
      x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    else:
      x = nn.Conv(64, (3, 3), 1, padding=1, use_bias=False, dtype=self.dtype, name="stem")(x)
      x = nn.relu(norm(name="stem_norm")(x))
    for stage, blocks in enumerate(self.stage_sizes):
      for b in range(blocks):
        strides = 2 if stage > 0 and b == 0 else 1
        x = self.block(64 * 2**stage, strides, norm, self.zero_init_residual)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="classifier")(x).astype(jnp.float32)


ResNet6 = functools.partial(ResNet, stage_sizes=(1, 1), block=BasicBlock)  # tests, smoke runs
ResNet10 = functools.partial(ResNet, stage_sizes=(1, 1, 1, 1), block=BasicBlock)
ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), block=BasicBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block=BasicBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block=Bottleneck)
ResNet101 = functools.partial(ResNet, stage_sizes=(3, 4, 23, 3), block=Bottleneck)
ResNet152 = functools.partial(ResNet, stage_sizes=(3, 8, 36, 3), block=Bottleneck)
