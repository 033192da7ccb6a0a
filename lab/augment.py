"""The experiments' per-example image preprocessing on the host: pure numpy functions of
``(image, rng)``, the transforms a `mnjax.data.Loader` applies.

Example:
  >>> train, evaluate = lab.augment.transforms("imagenet2012", image_size=224)
  >>> image_uint8 = np.zeros((300, 400, 3), np.uint8)       # what a Source returns
  >>> x = train(image_uint8, np.random.default_rng(0))
  >>> x.shape, x.dtype
  ((224, 224, 3), dtype('float32'))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = [
    "MEAN_STD",
    "center_crop",
    "normalize",
    "pad_and_random_crop",
    "random_flip",
    "random_resized_crop",
    "transforms",
]

#: Per-channel mean and standard deviation of the pixel values in [0, 1].
MEAN_STD = {
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "synthetic": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ((0.1307,), (0.3081,)),
    "digits": ((0.3,), (0.38,)),
}

Transform = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  from PIL import Image  # noqa: PLC0415  (the data extra)

  if image.shape[:2] == (height, width):
    return image
  squeeze = image.shape[-1] == 1
  pil = Image.fromarray(image[..., 0] if squeeze else image)
  out = np.asarray(pil.resize((width, height), Image.BILINEAR))
  return out[..., None] if squeeze else out


def random_resized_crop(image: np.ndarray, rng: np.random.Generator, size: int,
                        scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> np.ndarray:
  """A random crop of `scale` of the area and `ratio` aspect, resized to ``size x size``.

  Example:
    >>> rng = np.random.default_rng(0)
    >>> random_resized_crop(np.zeros((300, 400, 3), np.uint8), rng, 224).shape
    (224, 224, 3)
  """
  height, width = image.shape[:2]
  area = height * width
  for _ in range(10):  # torchvision's sampling: ten tries, then a center crop
    target = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
    w = int(round(math.sqrt(target * aspect)))
    h = int(round(math.sqrt(target / aspect)))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return _resize(image[top:top + h, left:left + w], size, size)
  side = min(height, width)
  top, left = (height - side) // 2, (width - side) // 2
  return _resize(image[top:top + side, left:left + side], size, size)


def center_crop(image: np.ndarray, size: int, crop_fraction: float = 0.875) -> np.ndarray:
  """Resize the short side to ``size / crop_fraction``, then take the central square.

  Example:
    >>> center_crop(np.zeros((300, 400, 3), np.uint8), 224).shape
    (224, 224, 3)
  """
  height, width = image.shape[:2]
  short = max(size, int(round(size / crop_fraction)))
  scale = short / min(height, width)
  h, w = max(size, int(round(height * scale))), max(size, int(round(width * scale)))
  image = _resize(image, h, w)
  top, left = (h - size) // 2, (w - size) // 2
  return image[top:top + size, left:left + size]


def pad_and_random_crop(image: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
  """Zero-pad `pad` pixels on each side and crop back to the original size at random.

  Example:
    >>> image = np.ones((32, 32, 3), np.uint8)
    >>> pad_and_random_crop(image, np.random.default_rng(0)).shape
    (32, 32, 3)
  """
  height, width = image.shape[:2]
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
  top, left = rng.integers(0, 2 * pad + 1, size=2)
  return padded[top:top + height, left:left + width]


def random_flip(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Mirror left-right with probability 1/2.

  Example:
    >>> image = np.arange(6, dtype=np.uint8).reshape(1, 2, 3)
    >>> random_flip(image, np.random.default_rng(0)).shape
    (1, 2, 3)
  """
  return image[:, ::-1] if rng.random() < 0.5 else image


def normalize(image: np.ndarray, name: str) -> np.ndarray:
  """uint8 pixels to float32, standardised with the dataset's `MEAN_STD`.

  Example:
    >>> round(float(normalize(np.full((2, 2, 1), 255, np.uint8), "mnist").max()), 3)
    2.821
  """
  mean, std = MEAN_STD[name]
  return ((image.astype(np.float32) / 255.0 - np.asarray(mean, np.float32))
          / np.asarray(std, np.float32))


def transforms(name: str, image_size: int | None = None) -> tuple[Transform, Transform]:
  """``(train, eval)`` preprocessing for `name`: ``(uint8 image, rng) -> float32 HWC array``.

  Recipes: ImageNet (random-resized crop, flip; eval: resize, center crop), CIFAR-10 (pad,
  random crop, flip), MNIST / digits (as is). `image_size`: the ImageNet recipe's (224).

  Example:
    >>> train, evaluate = transforms("cifar10")
    >>> image = np.zeros((32, 32, 3), np.uint8)
    >>> train(image, np.random.default_rng(0)).shape, evaluate(image, None).dtype
    ((32, 32, 3), dtype('float32'))
  """
  if name not in MEAN_STD:
    raise ValueError(f"transforms: no preprocessing for {name!r}; known: {sorted(MEAN_STD)}.")
  if name in ("imagenet2012", "synthetic"):
    size = image_size or 224

    def train(image, rng):
      return normalize(random_flip(random_resized_crop(image, rng, size), rng), name)

    def evaluate(image, rng):
      del rng
      return normalize(center_crop(image, size), name)

    return train, evaluate
  if name == "cifar10":
    def train(image, rng):
      return normalize(random_flip(pad_and_random_crop(image, rng), rng), name)
  else:
    def train(image, rng):
      del rng
      return normalize(image, name)

  def evaluate(image, rng):
    del rng
    return normalize(image, name)

  return train, evaluate
