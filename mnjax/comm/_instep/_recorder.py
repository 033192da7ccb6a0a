"""The timeline's recording side: handler, step and host events (docs/design/timeline.md)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import ffi
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

from mnjax.comm._instep import _native as native

__all__ = [
    "EVENT_DTYPE", "NATIVE_KINDS", "active", "drain", "host_span", "mark_step", "now_ns",
    "record", "set_active", "tag_for_bind", "tag_info", "tagging",
]

#: One event as the handlers write it (``Event`` in mpi_collectives.cc).
EVENT_DTYPE = np.dtype([("start_ns", "<i8"), ("end_ns", "<i8"), ("bytes", "<i8"),
                        ("comm", "<i8"), ("tag", "<i8"), ("step", "<i8"), ("kind", "<i8"),
                        ("published", "<i8")])
#: Names of the handlers' event kinds, by code.
NATIVE_KINDS = ("allreduce", "alltoall", "allgather", "step begin", "step end",
                "in-step exchange", "send", "recv", "bcast", "gather", "scatter", "reduce")
#: Kinds between two ranks only: never matched across all ranks (no wait for the last peer).
POINT_TO_POINT = ("send", "recv")


class _State:
  """Whether a timeline records, the host events since the last `drain`, the tags."""

  def __init__(self):
    self.on = False
    self.lock = threading.Lock()
    self.host: list[tuple] = []  # (kind, start_ns, end_ns, bytes, step)
    self.tags: dict[int, tuple[str, int, int]] = {}  # id -> (kind, bucket, bytes)
    self.ids = itertools.count(1)
    self.cursor = ctypes.c_uint64(0)
    self.native = False
    self.step = -1  # the host's current step (`set_step`)


_STATE = _State()
_CURRENT = threading.local()


def active() -> bool:
  """Whether a timeline is recording in this process.

  Example:
    >>> active()
    False
  """
  return _STATE.on


def _lib():
  try:
    return native._library()
  except Exception:  # noqa: BLE001 (no MPI compiler: host events only)
    return None


def set_active(on: bool, capacity: int = 1 << 16) -> None:
  """Switches recording on (the handlers into a ring of `capacity` events) or off.

  Example:
    >>> set_active(False)
  """
  lib = _lib()
  if lib is not None:
    lib.mnjax_timeline_enable.restype = ctypes.c_uint64
    lib.mnjax_timeline_enable.argtypes = [ctypes.c_int64]
    _STATE.cursor = ctypes.c_uint64(lib.mnjax_timeline_enable(capacity if on else 0))
  _STATE.native = lib is not None
  with _STATE.lock:
    _STATE.host = []
  _STATE.on = bool(on)


def now_ns() -> int:
  """The clock every event is stamped with (CLOCK_MONOTONIC, as the handlers'), in ns.

  Example:
    >>> now_ns() > 0
    True
  """
  return time.monotonic_ns()


def set_step(step: int) -> None:
  """The step host events are attributed to (the train loop's current step)."""
  _STATE.step = int(step)


def record(kind: str, start_ns: int, end_ns: int, *, bytes: int = 0) -> None:
  """Records a host operation over ``[start_ns, end_ns]`` (`now_ns`) if a timeline is on.

  Example:
    >>> start = now_ns()
    >>> record("broadcast", start, now_ns(), bytes=1024)    # no timeline on: nothing
  """
  if _STATE.on:
    with _STATE.lock:
      _STATE.host.append((kind, int(start_ns), int(end_ns), int(bytes), _STATE.step))


@contextlib.contextmanager
def host_span(kind: str, bytes: int = 0) -> Iterator[None]:
  """`record` of the block's duration.

  Example:
    >>> with host_span("broadcast", bytes=12):
    ...   pass
  """
  if not _STATE.on:
    yield
    return
  start = now_ns()
  try:
    yield
  finally:
    record(kind, start, now_ns(), bytes=bytes)


def drain() -> tuple[np.ndarray, list[tuple], int]:
  """``(handler events, host events, events lost)`` recorded since the last drain."""
  with _STATE.lock:
    host, _STATE.host = _STATE.host, []
  lib = _lib() if _STATE.native else None
  if lib is None:
    return np.zeros(0, EVENT_DTYPE), host, 0
  fn = lib.mnjax_timeline_drain
  fn.restype = ctypes.c_int64
  chunks, lost_total = [], 0
  while True:
    out = np.zeros(4096, EVENT_DTYPE)
    lost = ctypes.c_int64(0)
    n = fn(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(len(out)),
           ctypes.byref(_STATE.cursor), ctypes.byref(lost))
    lost_total += lost.value
    chunks.append(out[:n])
    if n < len(out):
      break
  return np.concatenate(chunks), host, lost_total


@contextlib.contextmanager
def tagging(kind: str, *, bucket: int = -1, bytes: int = 0) -> Iterator[None]:
  """Labels collectives traced inside with `kind`, `bucket`, `bytes` if a timeline is on.

  Example:
    >>> with tagging("bucket allreduce", bucket=0, bytes=4096):
    ...   pass                                    # mnjax collectives traced here
  """
  if not _STATE.on:
    yield
    return
  tag = next(_STATE.ids)
  _STATE.tags[tag] = (kind, int(bucket), int(bytes))
  before = getattr(_CURRENT, "tag", 0)
  _CURRENT.tag = tag
  try:
    with jax.named_scope(f"mnjax/{kind}" + (f" {bucket}" if bucket >= 0 else "")):
      yield
  finally:
    _CURRENT.tag = before


def tag_for_bind() -> int:
  """The tag a collective traced now carries to its handler (0: none)."""
  return getattr(_CURRENT, "tag", 0) if _STATE.on else 0


def tag_info(tag: int) -> tuple[str, int, int] | None:
  """``(kind, bucket, bytes)`` of a tag `tagging` registered in this process, or None."""
  return _STATE.tags.get(int(tag))


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def mark_step(step: Any, *, end: bool = False, after: Any = None) -> Any:
  """`step` through a start mark, or (`end`) an end mark after `after`; use it in place of `step`.

  Example:
    >>> jax.jit(lambda step: mark_step(step) + 1)(jnp.int32(4))   # no timeline on: nothing
    Array(5, dtype=int32)
  """
  if not (_STATE.on and _STATE.native and _on_cpu()):
    return step
  step = jnp.asarray(step)
  after = jnp.zeros((), jnp.float32) if after is None else jnp.asarray(after)
  marked = _mark_p.bind(step.astype(jnp.int32), after, kind=1 if end else 0)
  return marked.astype(step.dtype)


def completion(tree: Any) -> jax.Array:
  """A float32 scalar that depends on every leaf of `tree` (`mark_step`'s `after`)."""
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "size") and x.size]
  return sum((jnp.ravel(x)[0].real.astype(jnp.float32) for x in leaves),
             jnp.zeros((), jnp.float32))


def _mark_lowering(ctx, step, after, *, kind):
  native.register()
  return ffi.ffi_lowering("mnjax_mark", has_side_effect=True)(ctx, step, after,
                                                              kind=np.int64(kind))


_mark_p = Primitive("mnjax_mark")
_mark_p.def_abstract_eval(lambda step, after, **_: ShapedArray((), jnp.int32))
mlir.register_lowering(_mark_p, _mark_lowering, platform="cpu")
