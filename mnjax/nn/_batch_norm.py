"""`SyncBatchNorm`: batch normalization over the global batch (docs/design/allreduce.md)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as flax_dtypes

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host._broadcast import allreduce_persistent  # a host collective; exported here too
from mnjax.comm._instep import _exact as exact
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep._allreduce import sum_buffer

__all__ = ["SyncBatchNorm", "allreduce_persistent"]


class SyncBatchNorm(nn.Module):
  """flax ``nn.BatchNorm`` with statistics over every device of every rank of `comm` (ChainerMN's
  ``MultiNodeBatchNormalization``): the same attributes (after `comm`), variables and paths.
  Call it on every rank in the same layers and feature shapes (batch sizes may differ), inside
  `mnjax.data_parallel`. ``init`` issues no collective. Raises ValueError with ``axis_name``
  or ``axis_index_groups``. On an exact communicator (``replicas=``) the statistics, and their
  gradients, are exact sums: the same bits on any number of processes.

  Example:
    >>> norm = functools.partial(mnjax.SyncBatchNorm, comm)
    >>> bn = norm(use_running_average=False)          # in place of nn.BatchNorm(...)
    >>> layer = mnjax.SyncBatchNorm(comm, use_running_average=False)   # or one layer
    >>> x = jnp.arange(8.0).reshape(4, 2)            # this rank's 4 examples
    >>> y, new = layer.apply(layer.init(jax.random.key(0), x), x, mutable=["batch_stats"])
    >>> y.mean(axis=0).round(6).tolist()             # normalised over the global batch
    [0.0, 0.0]
  """

  comm: Communicator
  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Any = nn.initializers.zeros
  scale_init: Any = nn.initializers.ones
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    """Normalizes `x` with global batch statistics (or running ones); `mask`: True entries count."""
    check_communicator(self.comm, "SyncBatchNorm")
    if self.axis_name is not None or self.axis_index_groups is not None:
      raise ValueError(
          "SyncBatchNorm: axis_name/axis_index_groups must be None; the communicator"
          f" already reduces over every device of every rank (got axis_name={self.axis_name!r},"
          f" axis_index_groups={self.axis_index_groups!r}). For statistics over this"
          " process's devices only, use flax's nn.BatchNorm(axis_name=comm.axis_name) inside"
          " `with mnjax.process_local():` (data_parallel refuses it elsewhere).")
    use_running_average = nn.merge_param(
        "use_running_average", self.use_running_average, use_running_average)
    axes = tuple(a % x.ndim for a in np.atleast_1d(self.axis))
    reduction_axes = tuple(i for i in range(x.ndim) if i not in axes)
    feature_shape = tuple(x.shape[a] for a in axes)
    stat_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
    ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros(feature_shape, stat_dtype))
    ra_var = self.variable("batch_stats", "var", lambda: jnp.ones(feature_shape, stat_dtype))

    if use_running_average:
      mean, var = ra_mean.value, ra_var.value
    else:
      mean, var = self._batch_statistics(x, reduction_axes, mask)
      if not self.is_initializing():
        ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
        ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
    return self._normalize(x, mean, var, reduction_axes, feature_shape)

  def _batch_statistics(self, x, reduction_axes, mask):
    """Global mean and (biased) variance per feature; one or two chained collectives."""
    dtype = jnp.result_type(x) if self.dtype is None else self.dtype
    if self.force_float32_reductions:
      dtype = jnp.promote_types(dtype, jnp.float32)
    x = jnp.asarray(x, dtype)
    if mask is None:  # one count for every feature: one number on the wire, not a row
      weight = jnp.ones((), dtype)
      count = jnp.asarray(np.prod([x.shape[a] for a in reduction_axes]), dtype)
    else:
      weight = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape).astype(dtype)
      count = weight.sum(reduction_axes)
    # No collective during init (as flax): the other ranks need not exist yet.
    layer = "/".join(self.scope.path) or type(self).__qualname__
    reduce = (_local_sum if self.is_initializing()
              else functools.partial(_chained_sum, self.comm, layer))
    if self.use_fast_variance:
      s1, s2, n = reduce([(x * weight).sum(reduction_axes), (x * x * weight).sum(reduction_axes),
                          count])
      mean = s1 / n
      return mean, jnp.maximum(0.0, s2 / n - mean * mean)
    s1, n = reduce([(x * weight).sum(reduction_axes), count])
    mean = s1 / n
    centred = x - jnp.expand_dims(mean, reduction_axes)
    (s2,) = reduce([(centred * centred * weight).sum(reduction_axes)])
    return mean, s2 / n

  def _normalize(self, x, mean, var, reduction_axes, feature_shape):
    """flax's normalisation arithmetic, in the same order."""
    shape = [1] * x.ndim
    for a, size in zip((i for i in range(x.ndim) if i not in reduction_axes), feature_shape):
      shape[a] = size
    y = x - jnp.expand_dims(mean, reduction_axes)
    mul = jax.lax.rsqrt(jnp.expand_dims(var, reduction_axes) + self.epsilon)
    args = [x]
    if self.use_scale:
      scale = self.param("scale", self.scale_init, feature_shape, self.param_dtype).reshape(shape)
      if not self.force_float32_reductions:
        scale = jnp.asarray(scale, self.param_dtype)
      mul = mul * scale
      args.append(scale)
    y = y * mul
    if self.use_bias:
      bias = self.param("bias", self.bias_init, feature_shape, self.param_dtype).reshape(shape)
      if not self.force_float32_reductions:
        bias = jnp.asarray(bias, self.param_dtype)
      y = y + bias
      args.append(bias)
    return jnp.asarray(y, flax_dtypes.canonicalize_dtype(*args, dtype=self.dtype))


# flax auto-names submodules after __name__: keep nn.BatchNorm's variable paths.
SyncBatchNorm.__name__ = "BatchNorm"


def _local_sum(parts):
  return tuple(parts)


def _chained_sum(comm: Communicator, layer: str, parts: list) -> tuple:
  """Global sums of `parts` in one collective, chained and noted for the pre-flight check."""
  if comm.num_replicas == 1:
    return tuple(parts)
  if comm.size > 1 and not sequence.recording_open():
    raise RuntimeError(
        f"SyncBatchNorm layer {layer} is traced across {comm.size} processes outside"
        " mnjax.data_parallel (e.g. under plain jax.jit), where no rank can check that every"
        " rank runs the same SyncBatchNorm layers: a rank with another model would wait"
        " forever in a collective the others never issue. Wrap the function that applies the"
        " model in mnjax.data_parallel(fn, comm, batch_argnums=...) (for 'flat' it is jax.jit"
        " plus that check, once per trace), as make_train_step does.")
  flat = jnp.concatenate([jnp.ravel(p) for p in parts])
  # over=: a layer over a sub-communicator names its ranks (a model-parallel step pairs it).
  if comm.exact:  # two int32 sums (`sum_buffer`): the exponents, then the limbs
    sequence.note_collective(f"SyncBatchNorm layer {layer} (exact: exponents)", (exact.BINS,),
                             np.int32, over=comm.mpi_comm)
    sequence.note_collective(f"SyncBatchNorm layer {layer} (exact: limbs)",
                             (exact.LIMBS * flat.size,), np.int32, over=comm.mpi_comm)
  else:
    sequence.note_collective(f"SyncBatchNorm layer {layer}", flat.shape, flat.dtype,
                             over=comm.mpi_comm)
  if _xla_orders_it(comm):
    total = _xla_sum(comm, flat)
  else:
    total = _global_sum(comm, flat, sequence.ORDER.take(flat.dtype))
    sequence.ORDER.put(total)
  ends = np.cumsum([np.size(p) for p in parts])[:-1]
  return tuple(t.reshape(np.shape(p)) for t, p in zip(jnp.split(total, ends), parts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _global_sum(comm: Communicator, local: jax.Array, after: jax.Array) -> jax.Array:
  return sum_buffer(local, comm, after)


def _global_sum_fwd(comm, local, after):
  return sum_buffer(local, comm, after), after


def _global_sum_bwd(comm, after, cotangent):
  # Each rank's local sums enter every rank's output: the transpose is the same global sum.
  summed = sum_buffer(cotangent, comm, sequence.ORDER.take(cotangent.dtype))
  sequence.ORDER.put(summed)  # the gradient buckets come after it (`allreduce_tree`)
  # Zero, but from this collective's result (XLA keeps x * 0 for floats): orders the next one.
  return summed, jnp.zeros_like(after) + summed[-1].astype(after.dtype) * 0


_global_sum.defvjp(_global_sum_fwd, _global_sum_bwd)


def _xla_orders_it(comm: Communicator) -> bool:
  """Whether `comm`'s sum is XLA's own ``psum`` alone, which XLA orders itself."""
  return comm.kind == "xla" or (comm.kind == "single_node" and comm.size == 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _xla_sum(comm: Communicator, local: jax.Array) -> jax.Array:
  return sum_buffer(local, comm)


def _xla_sum_fwd(comm, local):
  return sum_buffer(local, comm), None


def _xla_sum_bwd(comm, _, cotangent):
  # Unchained, so XLA:GPU can combine parallel layers' backward sums.
  return (sum_buffer(cotangent, comm),)


_xla_sum.defvjp(_xla_sum_fwd, _xla_sum_bwd)


