"""Datasets mnjax can train on offline.

``digits``: the UCI handwritten digits (1,797 grayscale 8x8 images, 10 classes) that
scikit-learn ships inside its wheel — a real dataset that needs no download, so the main
job and the tests run on any machine. The split is fixed: a stratified 80/20 split drawn
with seed 0 (1,438 train, 359 test), identical on every rank and every run.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Split", "load_digits", "load", "DATASETS"]

DATASETS = ("digits",)


class Split(NamedTuple):
  """One split of an in-memory dataset: NHWC float32 images and int32 labels."""

  images: np.ndarray
  labels: np.ndarray
  num_classes: int

  def __len__(self) -> int:
    return len(self.labels)


def load_digits(split: str) -> Split:
  """The UCI digits as NHWC float32 in [0, 1]; ``split`` is ``"train"`` or ``"test"``.

  Example:
    >>> train = mnjax.data.load_digits("train")
    >>> train.images.shape, train.labels.shape
    ((1438, 8, 8, 1), (1438,))
  """
  if split not in ("train", "test"):
    raise ValueError(f"load_digits: split must be 'train' or 'test', got {split!r}.")
  from sklearn.datasets import load_digits as _sklearn_digits  # lazy: heavy import

  raw = _sklearn_digits()
  images = (raw.images.astype(np.float32) / 16.0)[..., None]
  labels = raw.target.astype(np.int32)
  # Stratified split: per class, a seeded permutation; 20% of each class goes to test.
  rng = np.random.default_rng(0)
  test = np.zeros(len(labels), bool)
  for c in range(10):
    members = rng.permutation(np.flatnonzero(labels == c))
    test[members[: round(0.2 * len(members))]] = True
  keep = test if split == "test" else ~test
  return Split(images[keep], labels[keep], 10)


def load(name: str, split: str) -> Split:
  """Loads a dataset by name (see `DATASETS`)."""
  if name == "digits":
    return load_digits(split)
  raise ValueError(
      f"unknown dataset {name!r}; available offline: {', '.join(DATASETS)}."
  )
