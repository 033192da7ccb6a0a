"""`multi_node_early_stopping`: stop when a metric averaged over the ranks stops improving."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mnjax.comm._communicator import Communicator, check_communicator
from mnjax.comm._host._agreement import check_same_tree
from mnjax.comm._host._broadcast import broadcast
from mnjax.train._metrics import allreduce_metrics

__all__ = ["EarlyStopping", "EarlyStoppingState", "multi_node_early_stopping"]

MODES = ("auto", "min", "max")


class EarlyStoppingState(NamedTuple):
  """Where early stopping stands.

  Attributes:
    best: the best global mean so far (``inf``/``-inf`` before the first check).
    bad_checks: checks since the best last improved.
    total, count: this rank's sum and number of values observed since the last check.
    stop: True once ``bad_checks`` reached ``patience`` (the same on every rank).
  """

  best: float
  bad_checks: int
  total: float
  count: int
  stop: bool


class EarlyStopping(NamedTuple):
  """``init()``, ``observe(state, value)`` (local) and ``check(state)`` (collective)."""

  init: Callable[[], EarlyStoppingState]
  observe: Callable[[EarlyStoppingState, Any], EarlyStoppingState]
  check: Callable[[EarlyStoppingState], EarlyStoppingState]


def multi_node_early_stopping(comm: Communicator, *, monitor: str = "loss", patience: int = 3,
                              mode: str = "auto") -> EarlyStopping:
  """Early stopping on a metric averaged over every rank's observations (ChainerMN's
  ``MultiNodeEarlyStoppingTrigger``): call ``check`` on every rank at the same steps.

  Args:
    monitor: the metric's name; with ``mode="auto"`` a name containing ``"accuracy"`` is
      maximised, anything else minimised.
    patience: checks without improvement (NaN counts as none) before ``state.stop``.
    mode: ``"auto"``, ``"min"`` or ``"max"``; all three are compared across ranks here.

  Example:
    >>> stopper = mnjax.train.multi_node_early_stopping(comm, monitor="accuracy", patience=2)
    >>> state = stopper.init()
    >>> for epoch_accuracy in [0.5, 0.7, 0.6, 0.65, 0.8]:
    ...   state = stopper.observe(state, epoch_accuracy)   # e.g. every step's accuracy
    ...   state = stopper.check(state)                     # at the end of each epoch
    ...   if state.stop:                                   # the same epoch on every rank
    ...     break
    >>> state.best, state.stop
    (0.7, True)
  """
  caller = "multi_node_early_stopping"
  check_communicator(comm, caller)
  check_same_tree({}, comm, caller,
                  arguments={"monitor": monitor, "patience": patience, "mode": mode})
  if not isinstance(monitor, str):
    raise TypeError(f"{caller}: monitor must be the metric's name (a str), got {monitor!r}.")
  if (not isinstance(patience, (int, np.integer)) or isinstance(patience, bool)
      or patience < 1):
    raise ValueError(f"{caller}: patience must be a positive int (checks without"
                     f" improvement before stopping), got {patience!r}.")
  if mode not in MODES:
    raise ValueError(f"{caller}: mode must be one of {MODES}, got {mode!r}.")
  maximise = mode == "max" or (mode == "auto" and "accuracy" in monitor)
  better = (lambda a, b: a > b) if maximise else (lambda a, b: a < b)

  def init() -> EarlyStoppingState:
    return EarlyStoppingState(best=-math.inf if maximise else math.inf, bad_checks=0,
                              total=0.0, count=0, stop=False)

  def observe(state: EarlyStoppingState, value: Any) -> EarlyStoppingState:
    array = np.asarray(value)
    if array.ndim != 0 or not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
      raise TypeError(f"{caller}: observe takes one real number (this step's {monitor}), got"
                      f" {type(value).__name__} of shape {array.shape}.")
    return state._replace(total=state.total + float(array), count=state.count + 1)

  def check(state: EarlyStoppingState) -> EarlyStoppingState:
    totals = allreduce_metrics({"total": np.float64(state.total),
                                "count": np.int64(state.count)}, comm)
    state = state._replace(total=0.0, count=0)
    if totals["count"] == 0:
      warnings.warn(f"{caller}: no rank observed {monitor} since the last check; nothing"
                    " compared.", stacklevel=2)
      return state
    mean = float(broadcast(np.float64(totals["total"] / totals["count"]), comm, root=0))
    if better(mean, state.best):
      state = state._replace(best=mean, bad_checks=0)
    else:
      state = state._replace(bad_checks=state.bad_checks + 1)
    return state._replace(stop=state.bad_checks >= patience)

  return EarlyStopping(init, observe, check)
