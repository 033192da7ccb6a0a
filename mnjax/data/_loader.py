"""This rank's batches of a random-access source, prepared in the background.

`Loader` shards a `mnjax.data.Source` with `mnjax.scatter_index` (ChainerMN's contiguous
block per rank of a permutation drawn from ``(seed, epoch)``), reads and preprocesses the
examples in a pool of worker threads (reading ArrayRecord, decoding JPEG and resizing with
Pillow release the GIL) and keeps ``prefetch`` batches ready in a queue, so the device is fed
while the previous step runs. ``loader.wait_seconds`` is the time the training loop spent
waiting for input: near zero means input is not the bottleneck.

Training (``train=True``): shards of equal length (``force_equal_length``), full batches
only, so every rank runs the same number of steps (a rank that stopped early would leave the
others waiting in the allreduce). Evaluation: an exact partition (every example exactly once
over all ranks), the last batch padded and masked; ranks may run one step more or less,
which is fine for steps without collectives.

Each example's augmentation draws from ``np.random.default_rng([seed, epoch, index])``: the
same on any rank, any number of workers, any run.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from mnjax.data._sharding import scatter_index
from mnjax.comm._communicator import Communicator, check_communicator

__all__ = ["Batch", "Loader"]


class Batch(NamedTuple):
  """One process batch: float32 NHWC images, int32 labels, bool mask (False: padding), and
  the examples' indices into the source."""

  images: np.ndarray
  labels: np.ndarray
  mask: np.ndarray
  indices: np.ndarray


class Loader:
  """Iterates this rank's batches of `source`, one epoch per `epoch` call.

  Args:
    source: random access, ``len(source)`` and ``source[i] -> (uint8 image, label)``.
    comm: the `Communicator`.
    batch_size: examples per step on this process (`mnjax.local_batch_size`).
    transform: ``transform(image, rng) -> float32 array`` of one fixed shape
      (`mnjax.data.augment.transforms`).
    train: shuffle, equal-length shards, full batches only (else: exact, padded, masked).
    seed: seed of the permutation and of the augmentation.
    prefetch: batches kept ready ahead of the training loop.
    workers: preprocessing threads (default: the CPUs this process may use, at most 16).

  Example:
    >>> train_fn, _ = mnjax.data.augment.transforms("cifar10")
    >>> loader = Loader(source, comm, 128, train_fn, train=True, seed=0)
    >>> for batch in loader.epoch(epoch):
    ...   state, metrics = step(state, batch.images, batch.labels)
  """

  def __init__(self, source: Any, comm: Communicator, batch_size: int,
               transform: Callable[[np.ndarray, np.random.Generator], np.ndarray], *,
               train: bool, seed: int = 0, prefetch: int = 2, workers: int | None = None):
    check_communicator(comm, "Loader")
    if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
      raise ValueError(f"Loader: batch_size must be a positive int, got {batch_size!r}.")
    if prefetch < 1:
      raise ValueError(f"Loader: prefetch must be >= 1, got {prefetch!r}.")
    self.source, self.comm, self.batch_size = source, comm, int(batch_size)
    self.transform, self.train, self.seed, self.prefetch = transform, train, seed, prefetch
    self.workers = workers or max(1, min(16, len(os.sched_getaffinity(0))))
    self.wait_seconds = 0.0  # time the consumer spent blocked on input, all epochs
    shard = len(self.indices(0)[0])
    if train and shard < self.batch_size:
      raise ValueError(
          f"Loader: this rank's shard has {shard} examples, fewer than one batch of"
          f" {self.batch_size}; use a smaller global batch or fewer ranks.")

  def indices(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``(indices, mask)`` for `epoch`, in reading order."""
    return scatter_index(len(self.source), self.comm, shuffle=self.train, seed=self.seed,
                         epoch=epoch, force_equal_length=self.train, return_mask=True)

  def steps(self, epoch: int = 0) -> int:
    """Steps this rank runs in `epoch` (the same on every rank when training)."""
    n = len(self.indices(epoch)[0])
    return n // self.batch_size if self.train else -(-n // self.batch_size)

  def _plan(self, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    indices, mask = self.indices(epoch)
    steps = self.steps(epoch)
    pad = steps * self.batch_size - len(indices)
    if pad > 0:  # evaluation: the last batch is padded with masked copies
      indices = np.concatenate([indices, np.full(pad, indices[0])])
      mask = np.concatenate([mask, np.zeros(pad, bool)])
    b = self.batch_size
    return [(indices[s * b:(s + 1) * b], mask[s * b:(s + 1) * b]) for s in range(steps)]

  def _example(self, epoch: int, index: int) -> tuple[np.ndarray, int]:
    image, label = self.source[index]
    rng = np.random.default_rng([int(self.seed), int(epoch), int(index)])
    return np.asarray(self.transform(image, rng), np.float32), label

  def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
    """This rank's batches of `epoch`, prepared `prefetch` batches ahead in the background.

    ``start`` skips the epoch's first batches without reading them: resuming mid-epoch
    from a checkpoint yields exactly the batches the interrupted run had not reached.
    """
    if not 0 <= start <= self.steps(epoch):
      raise ValueError(f"Loader.epoch: start must be in [0, {self.steps(epoch)}], got {start}.")
    plan = self._plan(epoch)[start:]
    ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
    stop = threading.Event()

    def produce():
      with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
        try:
          for idx, mask in plan:
            examples = list(pool.map(lambda i: self._example(epoch, i), idx))
            batch = Batch(np.stack([e[0] for e in examples]),
                          np.asarray([e[1] for e in examples], np.int32), mask, idx)
            while not stop.is_set():
              try:
                ready.put(batch, timeout=0.1)
                break
              except queue.Full:
                continue
            if stop.is_set():
              return
        except BaseException as e:  # noqa: BLE001  (handed to the consumer, raised there)
          ready.put(e)

    thread = threading.Thread(target=produce, name=f"mnjax-loader-epoch{epoch}", daemon=True)
    thread.start()
    try:
      for _ in plan:
        start = time.perf_counter()
        item = ready.get()
        self.wait_seconds += time.perf_counter() - start
        if isinstance(item, BaseException):
          raise RuntimeError(f"Loader: preparing a batch of epoch {epoch} failed on rank"
                             f" {self.comm.rank}: {item}") from item
        yield item
    finally:
      stop.set()
      thread.join()
