"""The run's work directory: ``config.json``, JSON-lines metrics and ``params.npz``.

Rank 0 writes; every call is collective, so that a failed write (a full disk, a read-only
directory, a file where a directory should be) ends the job with the same message on every
rank instead of a raw ``OSError`` on rank 0 alone (`lab.runner._lock.on_root`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from lab.runner._lock import check_not_taken, on_root
from mnjax.comm._communicator import Communicator

__all__ = ["MetricsLog", "save_params", "write_config"]


def _jsonable(value: Any) -> Any:
  if hasattr(value, "item"):  # numpy / jax scalars
    return value.item()
  if isinstance(value, (tuple, list)):
    return [_jsonable(v) for v in value]
  return value


def _write_json(workdir: str, path: str, data: dict) -> None:
  os.makedirs(workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=2, sort_keys=True)
  os.replace(path + ".tmp", path)


def write_config(workdir: str, config: Any, comm: Communicator) -> None:
  """Writes ``<workdir>/config.json`` (a dataclass or dict, plus the topology) on rank 0.

  Collective: a failed write raises the same `RuntimeError` on every rank.

  Example:
    >>> write_config("runs/digits", {"learning_rate": 0.1, "batch_size": 64}, comm)
    >>> with open("runs/digits/config.json") as f:
    ...   sorted(json.load(f))
    ['batch_size', 'learning_rate', 'topology']
  """
  data = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
  data["topology"] = {
      "kind": comm.kind,
      "size": comm.size,
      "inter_size": comm.inter_size,
      "local_device_count": comm.local_device_count,
  }
  data = {k: _jsonable(v) for k, v in data.items()}
  on_root(comm, workdir, "write config.json in the work directory", _write_json, workdir,
          os.path.join(workdir, "config.json"), data)


def _append(path: str, line: str) -> None:
  with open(path, "a") as f:
    f.write(line)
    f.flush()


def _after(line: str, epoch: int) -> bool:
  """Whether a log line is a record past `epoch` (or a torn line a killed write left)."""
  try:
    return line.strip() != "" and json.loads(line).get("epoch", epoch) > epoch
  except ValueError:
    return True


def _truncate(path: str, epoch: int) -> None:
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  kept = next((i for i, line in enumerate(lines) if _after(line, epoch)), len(lines))
  if kept < len(lines):
    with open(path + ".tmp", "w") as f:
      f.writelines(lines[:kept])
    os.replace(path + ".tmp", path)


class MetricsLog:
  """Appends one JSON object per line to ``<workdir>/metrics.jsonl`` (rank 0 writes).

  Collective: construct it and call `write` on every rank; a failed write raises the same
  `RuntimeError` on every rank.

  Example:
    >>> log = MetricsLog("runs/digits", comm)
    >>> log.write(epoch=1, train_loss=0.31, test_accuracy=0.97)
  """

  def __init__(self, workdir: str, comm: Communicator, name: str = "metrics.jsonl"):
    self.workdir, self.name = workdir, name
    self.path = os.path.join(workdir, name)
    self._comm = comm
    on_root(comm, workdir, "create the work directory", os.makedirs, workdir, 0o777, True)

  def write(self, **record: Any) -> None:
    record = {"time": time.time(), **{k: _jsonable(v) for k, v in record.items()}}
    on_root(self._comm, self.workdir, f"append to {self.name} in the work directory", _append,
            self.path, json.dumps(record) + "\n")

  def truncate_after(self, epoch: int) -> None:
    """Cuts the log back to its records up to `epoch` (a resumed run's restored position),
    from the first later record on: no duplicate epoch, no record of work a lost save
    undid. Collective, like `write`.

    Example:
      >>> log = MetricsLog("runs/digits", comm)
      >>> log.truncate_after(0)                      # resumed from scratch: no record is kept
    """
    on_root(self._comm, self.workdir, f"cut {self.name} back in the work directory", _truncate,
            self.path, epoch)


def _save_npz(workdir: str, path: str, params: Any) -> None:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  check_not_taken(workdir)
  os.makedirs(workdir, exist_ok=True)
  flat = {
      "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys): np.asarray(v)
      for keys, v in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  with open(path + ".tmp", "wb") as f:
    np.savez(f, **flat)
  os.replace(path + ".tmp", path)


def save_params(workdir: str, params: Any, comm: Communicator, name: str = "params.npz") -> str:
  """Writes a parameter pytree as ``<workdir>/params.npz`` (rank 0), keys ``a/b/c``.

  Collective: a failed write, or a work directory another run has locked since
  (`lab.runner.WorkdirLock`), raises the same `RuntimeError` on every rank.

  Example:
    >>> save_params("runs/digits", {"Dense_0": {"kernel": jnp.ones((2, 3))}}, comm)
    'runs/digits/params.npz'
    >>> with np.load("runs/digits/params.npz") as saved:
    ...   sorted(saved)
    ['Dense_0/kernel']
  """
  path = os.path.join(workdir, name)
  on_root(comm, workdir, f"write {name} in the work directory", _save_npz, workdir, path, params)
  return path
