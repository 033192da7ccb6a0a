"""Layer 3 — data: one path from a named dataset to each replica's examples.

* Sources (`open_source`): the one registry of datasets by name — the digits scikit-learn
  ships (offline), tensorflow-datasets' MNIST, CIFAR-10 and ImageNet (prepared ArrayRecord,
  never downloaded), and a synthetic stand-in — each a random-access uint8 `Source`. The
  small jobs hold a split in memory as a float32 `Split`: `load(name, split)` (or
  `load_digits(split)`) is `as_split` of the `Source`, not a second loader.
* Order: `global_batch_slices` is the one definition of the training order — each global
  batch a consecutive chunk of the epoch's permutation, process ``r`` its ``r``-th slice,
  the process's devices that slice in order — so a step's examples, and which replica sees
  each, do not depend on how replicas group into processes (4 x 1 trains like 2 x 2).
  `epoch_batches` (arrays in memory) and `Loader` (a `Source`) both use it.
* `Loader`: a rank's shuffled, augmented, prefetched batches of a `Source`.
* ChainerMN's sharding, kept as its API and split: `scatter_index` / `scatter_dataset` give
  each rank one contiguous block of the permutation (`shard_bounds`: what a rank holds, not
  how to cut batches), any dataset size included (empty or duplicated shards, masked).
* Root-only data: `scatter_dataset(..., root=r)` reads rank ``r``'s dataset alone and sends
  each rank its shard (ChainerMN's semantics; the same shards as when every rank holds it).
* The same batches on every rank, for models split over ranks:
  `create_multi_node_iterator` (one rank's batches, broadcast) and
  `create_synchronized_iterator` (one shared permutation, nothing sent);
  `create_empty_dataset` for the ranks that take no input.
* Agreement: each of these, `epoch_batches` and `Loader` first compares across ranks what
  decides the partition (dataset size, seed, epoch, global batch, options), one small host
  round per call: a value that differs on one rank raises on every rank.
* `augment`: the standard image augmentations, as pure functions of a key.

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
