"""`create_mnbn_model`: BatchNorm calls run as `SyncBatchNorm` (docs/design/allreduce.md)."""

from __future__ import annotations

import dataclasses
import threading

import flax.linen as nn

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.nn._batch_norm import SyncBatchNorm

__all__ = ["create_mnbn_model"]

#: The function flax runs for ``nn.BatchNorm.__call__`` (under its method wrapper).
_BATCH_NORM_CALL = nn.BatchNorm.__call__.__wrapped__

#: ``nn.BatchNorm``'s attributes that `SyncBatchNorm` takes as they are.
_COPIED = tuple(f.name for f in dataclasses.fields(nn.BatchNorm)
                if f.init and f.name not in ("parent", "name", "axis_name", "axis_index_groups"))

#: One converted class per (model class, communicator): equal models stay equal (jit caches).
_CLASSES: dict[tuple[type, Communicator], type] = {}

_active = threading.local()  # the communicators whose interceptor this thread runs under


def create_mnbn_model(model: nn.Module, comm: Communicator) -> nn.Module:
  """`model` with every flax ``nn.BatchNorm`` in it run as `mnjax.SyncBatchNorm` (ChainerMN's
  ``create_mnbn_model``): a subclass instance, used like `model`, with the same variables.
  `model`: an unbound flax module made outside any other module (e.g. a flax ResNet); it is
  not changed. Apply the result inside `mnjax.data_parallel`. Raises TypeError (not a flax
  module, or `comm` not a `Communicator`) or ValueError (`model` bound or a submodule).

  Example:
    >>> class Small(nn.Module):                       # BatchNorm made inline
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.BatchNorm(use_running_average=False)(nn.Dense(2)(x))
    >>> synced = mnjax.nn.create_mnbn_model(Small(), comm)
    >>> type(synced).__name__, isinstance(synced, Small)
    ('Small', True)
    >>> x = jnp.arange(8.0).reshape(4, 2)
    >>> variables = synced.init(jax.random.key(0), x)  # the same tree as Small()'s
    >>> y, _ = synced.apply(variables, x, mutable=["batch_stats"])
    >>> bool(abs(y.mean(0)).max() < 1e-5)             # normalised over the global batch
    True
  """
  caller = "create_mnbn_model"
  check_communicator(comm, caller)
  if not isinstance(model, nn.Module):
    raise TypeError(f"{caller}: expected a flax linen Module (e.g. a flax ResNet),"
                    f" got {type(model).__name__}.")
  if model.scope is not None or model.parent is not None:
    raise ValueError(
        f"{caller}: {type(model).__name__} is bound or is a submodule of another module;"
        " convert the top-level model before init/apply/bind, made outside any module (e.g."
        f" {caller}(MyModel(), comm)). Its submodules convert with it.")
  fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if f.init and f.name != "parent"}
  return _converted_class(type(model), comm)(**fields)


def _converted_class(cls: type, comm: Communicator) -> type:
  key = (cls, comm)
  if key not in _CLASSES:
    interceptor = _interceptor(comm)

    @nn.nowrap
    def _call_wrapped_method(self, fun, args, kwargs):
      ids = _active.__dict__.setdefault("ids", set())
      if id(comm) in ids:  # already converting (a nested call): once is enough
        return cls._call_wrapped_method(self, fun, args, kwargs)
      ids.add(id(comm))
      try:
        with nn.intercept_methods(interceptor):
          return cls._call_wrapped_method(self, fun, args, kwargs)
      finally:
        ids.discard(id(comm))

    _CLASSES[key] = type(cls.__name__, (cls,), {
        "_call_wrapped_method": _call_wrapped_method,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__qualname__} with SyncBatchNorm (mnjax.nn.create_mnbn_model).",
    })
  return _CLASSES[key]


def _interceptor(comm: Communicator):
  """Runs `SyncBatchNorm` in the scope of each flax ``BatchNorm.__call__``."""

  def intercept(next_fun, args, kwargs, context):
    layer = context.module
    if getattr(context.orig_method, "func", None) is not _BATCH_NORM_CALL:
      return next_fun(*args, **kwargs)
    if layer.axis_index_groups is not None:
      raise ValueError(
          f"create_mnbn_model: BatchNorm layer {'/'.join(layer.scope.path)} has"
          f" axis_index_groups={layer.axis_index_groups!r}: its statistics span a subgroup"
          " of devices, which SyncBatchNorm (the global batch) cannot keep. Drop"
          " axis_index_groups, or leave this model unconverted.")
    synced = SyncBatchNorm(comm, **{name: getattr(layer, name) for name in _COPIED},
                           parent=layer.scope)  # the layer's own scope: its variable paths
    return synced(*args, **kwargs)

  return intercept
