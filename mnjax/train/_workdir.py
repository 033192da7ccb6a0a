"""The run's work directory: ``config.json`` and JSON-lines metrics, written by rank 0 only."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from mnjax.comm._communicator import Communicator

__all__ = ["MetricsLog", "save_params", "write_config"]


def _jsonable(value: Any) -> Any:
  if hasattr(value, "item"):  # numpy / jax scalars
    return value.item()
  if isinstance(value, (tuple, list)):
    return [_jsonable(v) for v in value]
  return value


def write_config(workdir: str, config: Any, comm: Communicator) -> None:
  """Writes ``<workdir>/config.json`` (a dataclass or dict, plus the topology) on rank 0.

  Example:
    >>> write_config("runs/digits", {"learning_rate": 0.1, "batch_size": 64}, comm)
    >>> with open("runs/digits/config.json") as f:
    ...   sorted(json.load(f))
    ['batch_size', 'learning_rate', 'topology']
  """
  if not comm.is_root:
    return
  os.makedirs(workdir, exist_ok=True)
  data = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
  data["topology"] = {
      "kind": comm.kind,
      "size": comm.size,
      "inter_size": comm.inter_size,
      "local_device_count": comm.local_device_count,
  }
  path = os.path.join(workdir, "config.json")
  with open(path + ".tmp", "w") as f:
    json.dump({k: _jsonable(v) for k, v in data.items()}, f, indent=2, sort_keys=True)
  os.replace(path + ".tmp", path)


class MetricsLog:
  """Appends one JSON object per line to ``<workdir>/metrics.jsonl`` (rank 0 only).

  Example:
    >>> log = MetricsLog("runs/digits", comm)
    >>> log.write(epoch=1, train_loss=0.31, test_accuracy=0.97)
  """

  def __init__(self, workdir: str, comm: Communicator, name: str = "metrics.jsonl"):
    self.path = os.path.join(workdir, name)
    self._enabled = comm.is_root
    if self._enabled:
      os.makedirs(workdir, exist_ok=True)

  def write(self, **record: Any) -> None:
    if not self._enabled:
      return
    record = {"time": time.time(), **{k: _jsonable(v) for k, v in record.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()


def save_params(workdir: str, params: Any, comm: Communicator, name: str = "params.npz") -> str:
  """Writes a parameter pytree as ``<workdir>/params.npz`` (rank 0), keys ``a/b/c``.

  Example:
    >>> save_params("runs/digits", {"Dense_0": {"kernel": jnp.ones((2, 3))}}, comm)
    'runs/digits/params.npz'
    >>> with np.load("runs/digits/params.npz") as saved:
    ...   sorted(saved)
    ['Dense_0/kernel']
  """
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  path = os.path.join(workdir, name)
  if comm.is_root:
    os.makedirs(workdir, exist_ok=True)
    flat = {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys): np.asarray(v)
        for keys, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    with open(path + ".tmp", "wb") as f:
      np.savez(f, **flat)
    os.replace(path + ".tmp", path)
  return path
