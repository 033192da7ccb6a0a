"""Data: from a named dataset to each replica's examples (docs/design/data.md).

* Sources: `open_source` (by name, random-access uint8 `Source`s); `load` / `load_digits`
  hold a small split in memory as a float32 `Split`.
* Order: `global_batch_slices`, behind `epoch_batches` (arrays) and `Loader` (a `Source`).
* ChainerMN's: `scatter_index` / `scatter_dataset` (one block per rank), and for the same
  batches on every rank `create_multi_node_iterator`, `create_synchronized_iterator`,
  `create_empty_dataset`. What partitions data first checks the ranks passed equal values.

Example::

    train = mnjax.data.load("digits", "train")
    for idx, _ in mnjax.data.epoch_batches(len(train), comm, 64, shuffle=True, epoch=3):
      state, metrics = step(state, train.images[idx], train.labels[idx])
"""

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
