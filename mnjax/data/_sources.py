"""Image classification datasets by name, as random-access sources of ``(image, label)``.

``open_source(name, split)`` returns a `Source`: ``len(source)`` and ``source[i]`` (a uint8
HWC image and an int label), plus ``num_classes``. Random access is what lets every rank read
only its own shard (`mnjax.scatter_index`) without reading the rest.

* ``mnist``, ``cifar10``, ``imagenet2012``: tensorflow-datasets' ``tfds.data_source``
  (ArrayRecord files, no TensorFlow needed). Prepare a dataset once, on a machine that has
  it (ImageNet needs its archives in ``<data_dir>/downloads/manual``)::

      pip install 'mnjax[data]'
      tfds build imagenet2012 --data_dir /shared/tfds --file_format array_record

  then pass ``--data_dir /shared/tfds``. Nothing is ever downloaded at run time: a dataset
  that is not prepared raises an error saying the above.
* ``digits``: the UCI handwritten digits scikit-learn ships (8x8 grayscale), offline.
* ``synthetic``: ImageNet-shaped random images (1000 classes), generated per index from a
  seed: for throughput runs without data.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = ["Source", "open_source", "SOURCES", "TFDS_NAMES", "SYNTHETIC_SIZE"]

TFDS_NAMES = ("mnist", "cifar10", "imagenet2012")
SOURCES = ("digits", "synthetic") + TFDS_NAMES
SYNTHETIC_SIZE = {"train": 1_281_167, "test": 50_000}  # ImageNet-1k's train/validation sizes


class Source(NamedTuple):
  """A random-access split: ``examples[i]`` is a dict with ``image`` (uint8 HWC), ``label``.

  Example:
    >>> source = open_source("digits", "train")
    >>> image, label = source[0]
  """

  name: str
  examples: Sequence[Any]
  num_classes: int

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
    example = self.examples[int(i)]
    return np.asarray(example["image"]), int(example["label"])


class _Digits(Sequence):
  """The sklearn digits as uint8 (0..16 scaled to 0..255), 8x8x1."""

  def __init__(self, split: str):
    from mnjax.data._datasets import load_digits  # noqa: PLC0415

    data = load_digits(split)
    self._images = np.round(data.images * 255).astype(np.uint8)
    self._labels = data.labels

  def __len__(self):
    return len(self._labels)

  def __getitem__(self, i):
    return {"image": self._images[i], "label": self._labels[i]}


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
  """A dataset split by name (see `SOURCES`); ``split`` is ``"train"`` or ``"test"``.

  Args:
    name: ``digits``, ``synthetic``, ``mnist``, ``cifar10`` or ``imagenet2012``.
    split: ``"train"`` or ``"test"`` (ImageNet's test split is its ``validation``).
    data_dir: where tensorflow-datasets keeps prepared datasets (tfds' default if None).
    image_size: side of the ``synthetic`` images.
    synthetic_size: number of ``synthetic`` examples (default: ImageNet's split sizes).
    seed: seed of the ``synthetic`` images.

  Example:
    >>> source = mnjax.data.open_source("cifar10", "train", data_dir="/data/tfds")
    >>> len(source), source.num_classes
    (50000, 10)
  """
  if split not in ("train", "test"):
    raise ValueError(f"open_source: split must be 'train' or 'test', got {split!r}.")
  if name == "digits":
    return Source(name, _Digits(split), 10)
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
