"""Image classification datasets by name (`open_source`), and their in-memory float view.

Example:
  >>> train = mnjax.data.load("digits", "train")
  >>> train.images.shape, train.images.dtype, train.num_classes
  ((1438, 8, 8, 1), dtype('float32'), 10)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "DATASETS",
    "SOURCES",
    "SYNTHETIC_SIZE",
    "TFDS_NAMES",
    "Source",
    "Split",
    "as_split",
    "load",
    "load_digits",
    "open_source",
]

TFDS_NAMES = ("mnist", "cifar10", "imagenet2012")
SOURCES = ("digits", "synthetic") + TFDS_NAMES
#: The sources `load` holds in memory as float32 (the others are for `mnjax.data.Loader`).
DATASETS = ("digits", "mnist", "cifar10")
SYNTHETIC_SIZE = {"train": 1_281_167, "test": 50_000}  # ImageNet-1k's train/validation sizes
_SPLITS = ("train", "test")


class Source(NamedTuple):
  """A random-access split: ``examples[i]`` is a dict with ``image`` (uint8 HWC), ``label``.

  Example:
    >>> source = mnjax.data.open_source("digits", "train")
    >>> image, label = source[0]
    >>> len(source), image.shape, image.dtype
    (1438, (8, 8, 1), dtype('uint8'))
  """

  name: str
  examples: Sequence[Any]
  num_classes: int

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
    example = self.examples[int(i)]
    return np.asarray(example["image"]), int(example["label"])


class Split(NamedTuple):
  """One split held in memory: NHWC float32 images in [0, 1] and int32 labels.

  Example:
    >>> test = mnjax.data.load_digits("test")
    >>> len(test), test.labels.dtype
    (359, dtype('int32'))
  """

  images: np.ndarray
  labels: np.ndarray
  num_classes: int

  def __len__(self) -> int:
    return len(self.labels)


class _Arrays(Sequence):
  """Examples already in memory: uint8 NHWC `images` and int32 `labels`."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images, self.labels = images, labels

  def __len__(self):
    return len(self.labels)

  def __getitem__(self, i):
    return {"image": self.images[i], "label": self.labels[i]}


def _digits(split: str) -> _Arrays:
  """The sklearn digits, stratified 80/20 with seed 0, as uint8 (0..16 scaled to 0..255)."""
  from sklearn.datasets import load_digits as _sklearn_digits  # noqa: PLC0415 (heavy import)

  raw = _sklearn_digits()
  labels = raw.target.astype(np.int32)
  rng = np.random.default_rng(0)
  test = np.zeros(len(labels), bool)
  for c in range(10):
    members = rng.permutation(np.flatnonzero(labels == c))
    test[members[: round(0.2 * len(members))]] = True
  keep = test if split == "test" else ~test
  images = np.round(raw.images[keep] * (255 / 16)).astype(np.uint8)[..., None]
  return _Arrays(images, labels[keep])


class _Synthetic(Sequence):
  """Random uint8 images of one size; example ``i`` is the same on every call and rank."""

  def __init__(self, size: int, image_size: int, seed: int):
    self._size, self._image_size, self._seed = size, image_size, seed

  def __len__(self):
    return self._size

  def __getitem__(self, i):
    if not 0 <= i < self._size:
      raise IndexError(i)
    rng = np.random.default_rng([self._seed, int(i)])
    image = rng.integers(0, 256, (self._image_size, self._image_size, 3), np.uint8)
    return {"image": image, "label": int(i) % 1000}


def open_source(name: str, split: str, *, data_dir: str | None = None,
                image_size: int = 224, synthetic_size: int | None = None,
                seed: int = 0) -> Source:
  """A dataset split by name (one of `SOURCES`), ``"train"`` or ``"test"`` (ImageNet's validation).

  ``mnist``, ``cifar10``, ``imagenet2012``: tensorflow-datasets' ArrayRecord prepared in
  `data_dir` (never downloaded). `image_size`, `synthetic_size`, `seed`: ``synthetic``'s.

  Example:
    >>> source = mnjax.data.open_source("synthetic", "train", image_size=32)
    >>> len(source), source.num_classes, source[0][0].shape
    (1281167, 1000, (32, 32, 3))
    >>> cifar = mnjax.data.open_source("cifar10", "train", data_dir="/data/tfds")  # doctest: +SKIP
  """
  if split not in _SPLITS:
    raise ValueError(f"open_source: split must be 'train' or 'test', got {split!r}.")
  if name == "digits":
    return Source(name, _digits(split), 10)
  if name == "synthetic":
    size = SYNTHETIC_SIZE[split] if synthetic_size is None else int(synthetic_size)
    return Source(name, _Synthetic(size, image_size, seed + (split == "test")), 1000)
  if name in TFDS_NAMES:
    return _open_tfds(name, split, data_dir)
  raise ValueError(f"open_source: unknown dataset {name!r}; available: {', '.join(SOURCES)}.")


def _open_tfds(name: str, split: str, data_dir: str | None) -> Source:
  try:
    import tensorflow_datasets as tfds  # noqa: PLC0415
  except ImportError as e:
    raise ImportError(
        f"open_source: dataset {name!r} is read with tensorflow-datasets, which is not"
        " installed. Install the data extra: pip install 'mnjax[data]'.") from e
  tfds_split = "validation" if (name == "imagenet2012" and split == "test") else split
  try:
    examples = tfds.data_source(name, split=tfds_split, data_dir=data_dir, download=False)
  except Exception as e:  # tfds raises several kinds; say what to do instead
    where = data_dir or "tfds' default data_dir (~/tensorflow_datasets)"
    manual = (" ImageNet cannot be downloaded automatically: put ILSVRC2012_img_train.tar and"
              " ILSVRC2012_img_val.tar in <data_dir>/downloads/manual first."
              if name == "imagenet2012" else "")
    raise FileNotFoundError(
        f"open_source: dataset {name!r} (split {tfds_split!r}) is not prepared as ArrayRecord"
        f" in {where}. mnjax reads data but never downloads it. Prepare it once on a machine"
        f" with the data: `tfds build {name} --data_dir DIR --file_format array_record`, then"
        f" pass --data_dir DIR.{manual} (tfds said: {type(e).__name__}: {str(e)[:300]})") from e
  num_classes = examples.dataset_info.features["label"].num_classes
  return Source(name, examples, int(num_classes))


def as_split(source: Source) -> Split:
  """The whole `source` in memory (for `DATASETS`): float32 NHWC in [0, 1], int32 labels.

  Example:
    >>> split = mnjax.data.as_split(mnjax.data.open_source("digits", "test"))
    >>> float(split.images.max()), split.labels[:5].tolist()
    (1.0, [5, 9, 2, 4, 6])
  """
  if not isinstance(source, Source):
    raise TypeError(f"as_split: expected a mnjax.data.Source (open_source(...)), got"
                    f" {type(source).__name__}.")
  if isinstance(source.examples, _Arrays):
    images, labels = source.examples.images, source.examples.labels
  else:
    pairs = [source[i] for i in range(len(source))]
    images = np.stack([image for image, _ in pairs])
    labels = np.asarray([label for _, label in pairs])
  if images.ndim == 3:  # grayscale stored HW: give it its channel
    images = images[..., None]
  return Split(images.astype(np.float32) / np.float32(255), labels.astype(np.int32),
               source.num_classes)


def load(name: str, split: str, **options) -> Split:
  """A split of one of `DATASETS` in memory as float32 (`as_split` of `open_source`).

  Example:
    >>> train = mnjax.data.load("digits", "train")
    >>> len(train), train.images.shape[1:]
    (1438, (8, 8, 1))
  """
  if name not in DATASETS:
    hint = (f" {name!r} is too large to hold in memory: read it with"
            " mnjax.data.open_source and mnjax.data.Loader." if name in SOURCES else "")
    raise ValueError(
        f"load: unknown dataset {name!r}; in-memory datasets: {', '.join(DATASETS)}.{hint}")
  return as_split(open_source(name, split, **options))


def load_digits(split: str) -> Split:
  """``load("digits", split)``: the UCI digits as float32 NHWC in [0, 1]; offline.

  Example:
    >>> train = mnjax.data.load_digits("train")
    >>> train.images.shape, train.labels.shape
    ((1438, 8, 8, 1), (1438,))
  """
  if split not in _SPLITS:
    raise ValueError(f"load_digits: split must be 'train' or 'test', got {split!r}.")
  return load("digits", split)
