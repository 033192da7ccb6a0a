"""`Loader`: this rank's batches of a `Source`, prepared in background threads."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.data._agreement import check_same_plan
from mnjax.data._sharding import _slices

__all__ = ["Batch", "Loader"]


class Batch(NamedTuple):
  """One process batch: float32 NHWC images, int32 labels, mask (False: padding), indices."""

  images: np.ndarray
  labels: np.ndarray
  mask: np.ndarray
  indices: np.ndarray


class Loader:
  """Iterates this rank's batches of `source`, one epoch per `epoch` call.

  Collective at construction and at each `epoch` call (the ranks compare what decides
  their batches): build it and call `epoch` on every rank.

  Args:
    source: random access, ``len(source)`` and ``source[i] -> (uint8 image, label)``.
    comm: the `Communicator`.
    batch_size: examples per step on this process (`mnjax.local_batch_size` of the global
      batch, which is ``batch_size * comm.size``); a multiple of ``comm.local_device_count``.
    transform: ``transform(image, rng) -> float32 array`` of one fixed shape.
    train: shuffle, full global batches only (else: in order, padded, masked).
    seed: seed of the permutation and of the augmentation.
    prefetch: batches kept ready ahead of the training loop.
    workers: preprocessing threads (default: the CPUs this process may use, at most 16).

  Example:
    >>> source = mnjax.data.open_source("synthetic", "train", image_size=8, synthetic_size=64)
    >>> train_fn = lambda image, rng: image.astype(np.float32) / 255   # e.g. crops, flips
    >>> loader = mnjax.data.Loader(source, comm, 16 // comm.size, train_fn, train=True)
    >>> for batch in loader.epoch(0):
    ...   images, labels = batch.images, batch.labels  # state, metrics = step(state, ...)
    >>> loader.steps(), images.shape[1:]
    (4, (8, 8, 3))
  """

  def __init__(self, source: Any, comm: Communicator, batch_size: int,
               transform: Callable[[np.ndarray, np.random.Generator], np.ndarray], *,
               train: bool, seed: int = 0, prefetch: int = 2, workers: int | None = None):
    check_communicator(comm, "Loader")
    if prefetch < 1:
      raise ValueError(f"Loader: prefetch must be >= 1, got {prefetch!r}.")
    self.source, self.comm, self.batch_size = source, comm, batch_size
    self.transform, self.train, self.seed, self.prefetch = transform, train, seed, prefetch
    check_same_plan(comm, "Loader", self._values())
    if (not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool)
        or batch_size <= 0 or batch_size % comm.local_device_count):
      raise ValueError(
          f"Loader: batch_size (examples per step on this process) must be a positive"
          f" multiple of the {comm.local_device_count} local device(s), got {batch_size!r};"
          " pass mnjax.local_batch_size(global_batch_size, comm).")
    self.batch_size = int(batch_size)
    self.global_batch_size = self.batch_size * comm.size
    self.workers = workers or max(1, min(16, len(os.sched_getaffinity(0))))
    self.wait_seconds = 0.0  # time the consumer spent blocked on input, all epochs
    self._plan(0)  # fails here, on every rank, if the source has no full global batch

  def _values(self, **more: Any) -> dict[str, Any]:
    """What decides this rank's batches (the seed orders them only when training)."""
    values = {"dataset size": len(self.source), "batch_size": self.batch_size,
              "train": self.train}
    return values | ({"seed": self.seed} if self.train else {}) | more

  def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, mask)`` of shape ``(steps, batch_size)``: this rank's slice per step."""
    return _slices(len(self.source), self.global_batch_size, self.comm.rank, self.comm.size,
                   shuffle=self.train, seed=self.seed, epoch=epoch,
                   drop_remainder=self.train, caller="Loader")

  def indices(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``(indices, mask)`` for `epoch`, in reading order (padding masked False).

    Example:
      >>> source = mnjax.data.open_source("digits", "test")
      >>> loader = mnjax.data.Loader(source, comm, 8, lambda image, rng: image, train=False)
      >>> indices, mask = loader.indices(0)  # one process: 45 batches of 8, the last padded
      >>> len(indices), int(mask.sum())
      (360, 359)
    """
    indices, mask = self._plan(epoch)
    return indices.reshape(-1), mask.reshape(-1)

  def steps(self, epoch: int = 0) -> int:
    """Steps every rank runs in `epoch` (the same on every rank)."""
    return len(self._plan(epoch)[0])

  def _example(self, epoch: int, index: int) -> tuple[np.ndarray, int]:
    image, label = self.source[index]
    rng = np.random.default_rng([int(self.seed), int(epoch), int(index)])
    return np.asarray(self.transform(image, rng), np.float32), label

  def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
    """This rank's batches of `epoch` from batch `start` (to resume); collective when called."""
    check_same_plan(self.comm, "Loader.epoch", self._values(epoch=epoch, start=start))
    plan = list(zip(*self._plan(epoch)))
    if not 0 <= start <= len(plan):
      raise ValueError(f"Loader.epoch: start must be in [0, {len(plan)}], got {start}.")
    return self._batches(epoch, plan[start:])

  def _batches(self, epoch: int, plan: list) -> Iterator[Batch]:
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
        began = time.perf_counter()
        item = ready.get()
        self.wait_seconds += time.perf_counter() - began
        if isinstance(item, BaseException):
          raise RuntimeError(f"Loader: preparing a batch of epoch {epoch} failed on rank"
                             f" {self.comm.rank}: {item}") from item
        yield item
    finally:
      stop.set()
      thread.join()
