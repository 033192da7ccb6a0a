"""`allreduce_gradients`, and its checks and reduction shared with the other wrappers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mnjax.comm._communicator import check_communicator
from mnjax.comm._instep import _allreduce as collectives
from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep import _sequence as sequence
from mnjax.comm._instep import _wire as wire
from mnjax.guard import _preflight as preflight
from mnjax.guard import _program as program

__all__ = ["GradientExchange", "allreduce_gradients", "check_inner_update", "gradient_exchange"]


def allreduce_gradients(comm, *, mean: bool = True, wire_dtype: Any = None,
                        bucket_bytes: int | str | None = "auto",
                        preflight_timeout: float = preflight.DEFAULT_TIMEOUT,
                        ) -> optax.GradientTransformation:
  """Averages (or sums) gradients over all replicas: a stateless optax transformation.

  Args:
    comm: the `Communicator` from `mnjax.create_communicator`.
    mean: average over replicas (default); ``False`` sums.
    wire_dtype: None or ``jnp.bfloat16`` / ``jnp.float16`` (ChainerMN's ``allreduce_grad_dtype``):
      gradients travel in 16 bits, summed in float32 (float16: Inf above 65504).
    bucket_bytes: the largest fused buffer in wire bytes, one allreduce each; ``"auto"``:
      `mnjax.comm.default_bucket_bytes`; None: one buffer per dtype (ChainerMN's).
    preflight_timeout: seconds to wait at the first trace for every rank, then raise.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> tx = optax.chain(mnjax.allreduce_gradients(comm, wire_dtype=jnp.bfloat16),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> def loss_fn(params, x):
    ...   return jnp.mean((x @ params["w"]) ** 2)
    >>> params = {"w": jnp.ones(3)}
    >>> opt_state = tx.init(params)
    >>> @jax.jit
    ... def step(params, opt_state, batch):
    ...   grads = jax.grad(loss_fn)(params, batch)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> params, opt_state = step(params, opt_state, jnp.ones((4, 3)))
    >>> [round(w, 3) for w in params["w"].tolist()]     # 1 - 0.1 x the mean gradient, 6
    [0.4, 0.4, 0.4]
  """
  exchange = gradient_exchange(comm, "allreduce_gradients", mean=mean, wire_dtype=wire_dtype,
                               bucket_bytes=bucket_bytes, preflight_timeout=preflight_timeout)

  def init_fn(params):
    exchange.check_params(params)
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    exchange.check(updates, params, state)
    # A Python float is a float32 under jit (`leaf_dtype`): give it that dtype for the buckets.
    return exchange.reduce(jax.tree.map(
        lambda g: jnp.asarray(g) if isinstance(g, (float, complex)) else g, updates)), state

  return optax.GradientTransformation(init_fn, update_fn)


class GradientExchange(NamedTuple):
  """What a gradient transformation that exchanges gradients is built from.

  Attributes:
    check_params: ``(params) -> None``: refuses, at ``init``, leaves that cannot be reduced.
    check: ``(updates, params, state, **more) -> None``: the checks when traced.
    reduce: ``(tree, keep_inputs=False) -> tree``: the in-step allreduce with the exchange's
      options (`mnjax.comm.allreduce_tree`'s `keep_inputs`).
    mean: whether `reduce` averages (else sums).
  """

  check_params: Callable[[Any], None]
  check: Callable[..., None]
  reduce: Callable[..., Any]
  mean: bool


def gradient_exchange(comm, caller: str, *, mean: bool = True, wire_dtype: Any = None,
                      bucket_bytes: int | str | None = "auto",
                      preflight_timeout: float = preflight.DEFAULT_TIMEOUT,
                      options: dict | None = None) -> GradientExchange:
  """`allreduce_gradients`' checks and reduction for `caller`; `options` compared too.

  Example:
    >>> exchange = gradient_exchange(comm, "my_wrapper", mean=False)
    >>> exchange.reduce({"w": jnp.ones(2)})["w"].tolist() == [float(comm.size)] * 2
    True
  """
  check_communicator(comm, caller)
  if not isinstance(mean, bool):
    raise TypeError(f"{caller}: mean must be a bool, got {mean!r}.")
  wire_dtype = wire.check_wire_dtype(wire_dtype, caller)
  bucket_bytes = bucketing.check_bucket_bytes(bucket_bytes, caller, comm)
  real = wire_dtype is not None
  if real and comm.exact:
    raise ValueError(
        f"{caller}: wire_dtype={wire_dtype} rounds each gradient to 16 bits, but this"
        " communicator sums exactly (create_communicator(..., replicas=...)), so that the"
        " bits do not depend on the number of processes. Drop wire_dtype, or replicas=.")
  if not isinstance(preflight_timeout, (int, float)) or not preflight_timeout > 0:
    raise ValueError(f"{caller}: preflight_timeout must be a positive number of seconds,"
                     f" got {preflight_timeout!r}.")
  compared = {"communicator kind": comm.kind, "replicas": comm.num_replicas,
              "exact sums": comm.exact, "mean": mean,
              "wire_dtype": str(wire_dtype), "bucket_bytes": bucket_bytes, **(options or {})}

  def check_params(params):
    # Gradients have their parameters' dtypes: refuse now rather than at the first step.
    bucketing.check_float_leaves(params, caller, real=real)

  def check(updates, params=None, state=None, **more):
    bucketing.check_float_leaves(updates, caller, real=real)
    if any(what == "local_sgd" for what, _ in sequence.enclosing_options()):
      raise ValueError(
          f"{caller} inside local_sgd's tx: local SGD steps on each replica's own gradient"
          " and exchanges only when the replicas meet, so an exchange in every step would"
          " undo it. Pass the plain optimizer: local_sgd(optax.adamw(1e-3), comm, every_k=8).")
    signature = dict(compared, **{"gradient tree": preflight.tree_signature(updates)})
    if params is not None:
      signature["parameter tree"] = preflight.tree_signature(params)
    if sequence.enclosing_options():  # e.g. accumulate_gradients' every_k
      signature["enclosing transformations"] = sequence.enclosing_options()
    signature.update(more)
    preflight.check_same_on_all_ranks(
        comm, "the gradients to exchange", signature, caller=caller,
        timeout=preflight_timeout)
    if comm.num_replicas > 1:  # an eager call: before its exchange, on every rank
      _check_traced(updates, state, params, comm, caller)

  def reduce(tree, keep_inputs=False):
    return collectives.allreduce_tree(
        tree, comm, mean=mean, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes,
        keep_inputs=keep_inputs)

  return GradientExchange(check_params, check, reduce, mean)


def check_inner_update(comm, caller: str, inner: Any, updates: Any, state: Any, params: Any,
                       extra_args: dict) -> None:
  """Raises the same `ValueError` on every rank unless all trace the same `inner` update.

  Example:
    >>> tx = optax.with_extra_args_support(optax.sgd(0.1))
    >>> g = {"w": jnp.ones(2)}
    >>> check_inner_update(comm, "my_wrapper", tx, g, tx.init(g), g, {})  # same everywhere
  """
  closed = jax.make_jaxpr(lambda u, s, p, e: inner.update(u, s, p, **e))(
      updates, state, params, extra_args)
  program.check_same_program(
      comm, closed, caller=caller,
      what="the update of the optimizer it wraps (its hyperparameters included)",
      fix="build the same optimizer, with the same hyperparameters, on every rank")


def _check_traced(updates: Any, state: Any, params: Any, comm, caller: str) -> None:
  """Raises unless ``update`` runs while a step is traced (the exchange needs a compiled step)."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((updates, state, params))):
    return
  if isinstance(jnp.zeros(()), jax.core.Tracer):  # traced, with constants only
    return
  flat = jax.tree_util.tree_flatten_with_path(updates)[0]
  came = "an empty gradient tree"
  if flat:
    path, leaf = flat[0]
    kind = (f"a Python {type(leaf).__name__} ({leaf!r})" if isinstance(leaf, (int, float, complex))
            else f"a concrete array {getattr(leaf, 'dtype', type(leaf).__name__)}"
                 f"{list(jnp.shape(leaf))}")
    came = f"leaf {jax.tree_util.keystr(path) or '<root>'} is {kind}"
  raise ValueError(
      f"{caller}: update was called outside a traced step (eagerly: {came}), but with"
      f" {comm.num_replicas} replicas its exchange runs only inside a compiled step. Call it"
      " inside the jitted step, where the gradients are computed: e.g. jax.jit(step) with"
      " tx.update inside, jax.jit(tx.update)(grads, opt_state, params), or"
      " mnjax.data_parallel(step, comm) for the multi-device kinds.")
