"""Layer 3 — data: one path from a named dataset to each replica's examples.

* Sources: `open_source` (the registry of datasets by name, each a random-access uint8
  `Source`); `load` / `load_digits` hold a small split in memory as a float32 `Split`.
* Order: `global_batch_slices` defines the training order, used by `epoch_batches` (arrays
  in memory) and `Loader` (a `Source`: shuffled, augmented, prefetched batches).
* ChainerMN's sharding: `scatter_index` / `scatter_dataset` give each rank one contiguous
  block of the permutation (``root=r``: only rank ``r`` holds the data and sends shards).
* The same batches on every rank, for models split over ranks:
  `create_multi_node_iterator`, `create_synchronized_iterator`, `create_empty_dataset`.
* `augment`: the standard image augmentations, as pure functions of a key.

Each function that partitions data first compares what decides the partition across ranks:
a value that differs on one rank raises on every rank. Design: docs/design/data.md.

Example::

    train = mnjax.data.load("digits", "train")
    for idx, _ in mnjax.data.epoch_batches(len(train), comm, 64, shuffle=True, epoch=3):
      state, metrics = step(state, train.images[idx], train.labels[idx])
"""

from mnjax.data import augment
from mnjax.data._empty import EmptyDataset, create_empty_dataset
from mnjax.data._iterators import create_multi_node_iterator, create_synchronized_iterator
from mnjax.data._loader import Batch, Loader
from mnjax.data._scatter import scatter_dataset
from mnjax.data._sharding import (
    SubDataset,
    epoch_batches,
    global_batch_slices,
    local_batch_size,
    scatter_index,
    shard_bounds,
    shard_indices,
)
from mnjax.data._sources import (
    DATASETS,
    SOURCES,
    SYNTHETIC_SIZE,
    TFDS_NAMES,
    Source,
    Split,
    as_split,
    load,
    load_digits,
    open_source,
)

__all__ = [
    "DATASETS",
    "SOURCES",
    "SYNTHETIC_SIZE",
    "TFDS_NAMES",
    "Batch",
    "EmptyDataset",
    "Loader",
    "Source",
    "Split",
    "SubDataset",
    "as_split",
    "augment",
    "create_empty_dataset",
    "create_multi_node_iterator",
    "create_synchronized_iterator",
    "epoch_batches",
    "global_batch_slices",
    "load",
    "load_digits",
    "local_batch_size",
    "open_source",
    "scatter_dataset",
    "scatter_index",
    "shard_bounds",
    "shard_indices",
]
