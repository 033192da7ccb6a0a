"""Refusing whole-tree transformations in `shard_optimizer`'s `tx` (docs/design/optim.md)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep import _scatter as scatter
from mnjax.guard import _preflight as preflight

__all__ = ["NEEDS_WHOLE_TREE", "check_elementwise_on_shares", "whole_tree_transformations"]

_CLIP = "pass clip_global_norm=max_norm to shard_optimizer instead (exact on shares)"
_WRAP = ("wrap the sharded optimizer instead, deciding on the whole (all-gathered) update:"
         " skip_nonfinite(shard_optimizer(tx, comm), on='update')")
_UNSHARDED = "use optax.chain(mnjax.allreduce_gradients(comm), tx) (unsharded state)"

#: Known transformations that need the whole tree or whole leaves, with the alternative.
NEEDS_WHOLE_TREE: dict[str, str] = {
    "clip_by_global_norm": f"global-norm clipping: {_CLIP}",
    "scale_by_trust_ratio": f"a LARS/LAMB trust ratio (per-leaf norms): {_UNSHARDED}",
    "adaptive_grad_clip": f"adaptive gradient clipping (per-unit norms): {_UNSHARDED}",
    "clip_by_block_rms": f"per-leaf RMS clipping: {_UNSHARDED}",
    "scale_by_param_block_norm": f"per-leaf parameter norms: {_UNSHARDED}",
    "scale_by_param_block_rms": f"per-leaf parameter RMS: {_UNSHARDED}",
    "normalize_by_update_norm": f"the global update norm: {_UNSHARDED}",
    "scale_by_factored_rms": f"Adafactor's factored (row/column) moments: {_UNSHARDED}",
    "scale_by_novograd": f"NovoGrad's per-leaf gradient norms: {_UNSHARDED}",
    "scale_by_lbfgs": f"L-BFGS's dot products over the tree: {_UNSHARDED}",
    "scale_by_polyak": f"the Polyak step's global gradient norm: {_UNSHARDED}",
    "scale_by_zoom_linesearch": f"a line search over the whole tree: {_UNSHARDED}",
    "scale_by_backtracking_linesearch": f"a line search over the whole tree: {_UNSHARDED}",
    "scale_by_distance_over_gradients": f"DoG's global norms: {_UNSHARDED}",
    "scale_by_muon": f"Muon's orthogonalised matrices (whole leaves): {_UNSHARDED}",
    "scale_by_sm3": f"SM3's per-axis statistics (whole leaves): {_UNSHARDED}",
    "sam": f"SAM's global gradient norm: {_UNSHARDED}",
    "add_noise": f"random noise (a share draws other numbers than its whole leaf): {_UNSHARDED}",
    "per_example_global_norm_clip": f"per-example global norms: {_UNSHARDED}",
    "differentially_private_aggregate": f"per-example clipping and noise: {_UNSHARDED}",
    "apply_if_finite": f"a finiteness decision over the whole tree: {_WRAP}",
    "skip_nonfinite": f"a finiteness decision over the whole tree: {_WRAP}",
    "dynamic_loss_scale": f"a finiteness decision over the whole tree: {_WRAP}",
    "accumulate_gradients": f"accumulation around the exchange: {_WRAP}",
    "allreduce_gradients": "a second gradient exchange: shard_optimizer already averages the"
                           " gradients, drop allreduce_gradients from tx",
}


def whole_tree_transformations(tx: Any) -> list[str]:
  """Names from `NEEDS_WHOLE_TREE` among the functions in `tx`'s closures (not classes).

  Example:
    >>> whole_tree_transformations(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1)))
    ['clip_by_global_norm']
    >>> whole_tree_transformations(optax.lamb(1e-3)), whole_tree_transformations(optax.adam(1))
    (['scale_by_trust_ratio'], [])
  """
  found: list[str] = []
  seen: set[int] = set()

  def walk(obj: Any, depth: int) -> None:
    if id(obj) in seen or depth > 50:
      return
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
      for x in (obj.func, *obj.args, *obj.keywords.values()):
        walk(x, depth + 1)
    elif hasattr(obj, "__code__") and hasattr(obj, "__qualname__"):
      name = obj.__qualname__.split(".<locals>")[0].split(".")[-1]
      if name in NEEDS_WHOLE_TREE and name not in found:
        found.append(name)
      for cell in obj.__closure__ or ():
        try:
          walk(cell.cell_contents, depth + 1)
        except ValueError:  # an empty cell
          pass
    elif isinstance(obj, (tuple, list)):
      for x in obj:
        walk(x, depth + 1)
    elif isinstance(obj, dict):
      for x in obj.values():
        walk(x, depth + 1)

  walk(tx.init, 0)
  walk(tx.update, 0)
  return found


def check_elementwise_on_shares(tx: Any, params: Any, *, caller: str = "shard_optimizer",
                                rtol: float = 1e-5) -> None:
  """Raises `ValueError` unless `tx` gives the same updates on shares as on whole leaves.

  Example:
    >>> check_elementwise_on_shares(optax.adam(1e-3), {"w": jnp.ones((4, 4))})
    >>> mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)   # reads shapes
    >>> check_elementwise_on_shares(optax.adamw(1e-3, mask=mask), {"w": jnp.ones((4, 4)),
    ...                                                           "b": jnp.ones(4)})
    Traceback (most recent call last):
    ValueError: shard_optimizer: tx gives other updates on shares ... leaf ['w']...elementwise...
  """
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(0)

  def draw(scale, low=0.0, ratio=1.0):  # `scale`: a number, or a function of (dtype, ratio)
    def one(x):
      dtype = np.dtype(bucketing.leaf_dtype(x))
      size = scale(dtype, ratio) if callable(scale) else scale
      noise = rng.standard_normal(tuple(min(d, 3) for d in np.shape(x)))
      return jnp.asarray((low + size * noise).astype(dtype))
    return jax.tree.unflatten(treedef, [one(x) for x in leaves])

  mini = draw(1.0, low=100.0)
  # (first, second) gradient per round; the second round crosses a clip's threshold.
  rounds = [(draw(1e3), draw(1e-2)), (draw(_large, ratio=1.0), draw(_large, ratio=0.1))]

  def two_steps(p, a, b):
    state = tx.init(p)
    u1, state = tx.update(a, state, p)
    p = optax.apply_updates(p, u1)
    u2, _ = tx.update(b, state, p)
    return u1, u2

  paths = [p for p, _, _ in preflight.tree_signature(params)]
  parts = 2
  cut = lambda t, r: jax.tree.map(lambda x: scatter.shard_leaf(x, r, parts), t)  # noqa: E731
  for number, (g1, g2) in enumerate(rounds):
    try:
      whole = two_steps(mini, g1, g2)
      by_share = [two_steps(cut(mini, r), cut(g1, r), cut(g2, r)) for r in range(parts)]
    except Exception as error:  # reported with the advice below
      raise ValueError(
          f"{caller}: tx fails on 1-D shares of the parameters ({type(error).__name__}:"
          f" {str(error)[:300]}); it needs whole leaves. {_UNSHARDED.capitalize()}.") from error
    _compare(whole, by_share, paths, number, caller, rtol)


def _large(dtype: np.dtype, ratio: float) -> float:
  """`ratio` x the probe's largest gradient for `dtype` (1e15, less where squares overflow)."""
  return ratio * min(1e15, float(np.sqrt(np.finfo(dtype).max)) * 1e-3)


def _compare(whole: Any, by_share: list[Any], paths: list[str], number: int, caller: str,
             rtol: float) -> None:
  """Raises unless the shares' updates of both probe steps, joined, are the whole ones."""
  for step in range(2):
    for i, path in enumerate(paths):
      ref = np.asarray(jax.tree.leaves(whole[step])[i], np.float64)
      rows = np.stack([np.asarray(jax.tree.leaves(s[step])[i], np.float64) for s in by_share])
      got = scatter.unshard_leaf(rows, ref.shape)
      scale = float(np.max(np.abs(ref), initial=0.0))
      if not np.allclose(got, ref, rtol=rtol, atol=rtol * scale, equal_nan=True):
        raise ValueError(
            f"{caller}: tx gives other updates on shares than on whole leaves (probe round"
            f" {number + 1}: step {step + 1}, leaf {path}, largest difference"
            f" {float(np.max(np.abs(got - ref))):.3g} for values up to {scale:.3g}), so it is"
            " not elementwise: a norm or statistic over leaves or the tree (global-norm"
            f" clipping: {_CLIP}), or a mask or label function that reads leaf shapes (shares"
            " are 1-D: pass the mask as a pytree of bools built from the full parameters)."
            f" Otherwise {_UNSHARDED}; check_elementwise=False skips this probe.")
