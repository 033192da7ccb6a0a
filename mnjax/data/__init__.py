"""Layer 3 — data: which examples each rank reads, and reading them.

* Sharding (ChainerMN's names): `scatter_index` / `scatter_dataset` give each rank its part
  of a dataset; `epoch_batches` yields an epoch's global batches in one global-batch-major
  order, so a result does not depend on how replicas group into processes.
* Sources: `open_source` opens a named dataset (the embedded digits, tensorflow-datasets'
  ImageNet, CIFAR, ... or a synthetic stand-in) as a uint8 `Source`; `load` / `load_digits`
  return float `Split`s for the small jobs.
* `Loader`: a rank's shuffled, augmented, prefetched batches of a `Source`.
* `augment`: the standard image augmentations, as pure functions of a key.

Example::

    index = mnjax.data.scatter_index(60_000, comm, shuffle=True, seed=0, epoch=3)
"""

from mnjax.data import augment
from mnjax.data._datasets import DATASETS, Split, load, load_digits
from mnjax.data._loader import Batch, Loader
from mnjax.data._sharding import (
    SubDataset, epoch_batches, local_batch_size, scatter_dataset, scatter_index)
from mnjax.data._sources import SOURCES, SYNTHETIC_SIZE, TFDS_NAMES, Source, open_source

__all__ = [
    "DATASETS",
    "SOURCES",
    "SYNTHETIC_SIZE",
    "TFDS_NAMES",
    "Batch",
    "Loader",
    "Source",
    "Split",
    "SubDataset",
    "augment",
    "epoch_batches",
    "load",
    "load_digits",
    "local_batch_size",
    "open_source",
    "scatter_dataset",
    "scatter_index",
]
