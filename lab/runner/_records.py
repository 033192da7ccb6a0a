"""What the training loop records of each epoch, besides the step's own metric sums.

`train_loop` builds an epoch's record (``metrics.jsonl``, TensorBoard, rank 0's line) from
the exact global metrics and these: the optimizer's values at the epoch's last step
(`optimizer_values`: learning rate, dynamic loss scale), the timeline's straggler shares
(`timeline_values`), the evaluation (`evaluation`), the parallel efficiency against a 1-rank
run's rate (`baseline_rate`), and the printed line (`epoch_line`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import optax

from lab.runner._classifier import TrainState, evaluate
from mnjax.comm._communicator import Communicator
from mnjax.optim._loss_scale import loss_scale_state

__all__ = ["baseline_rate", "epoch_line", "evaluation", "optimizer_values", "timeline_values"]


def baseline_rate(workdir: str) -> float | None:
  """Images/s per rank in the last epoch of a 1-rank run of the same config."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not workdir or not os.path.exists(path):
    return None
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return records[-1]["images_per_second_per_rank"] if records else None


def epoch_line(record: dict, compiled: bool) -> str:
  """Rank 0's line for an epoch's record."""
  r = record
  text = (f"epoch {r['epoch']:3d}  train loss {r['train_loss']:.4f} acc {r['train_accuracy']:.4f}"
          + (f"  test loss {r['test_loss']:.4f} acc {r['test_accuracy']:.4f}"
             if "test_accuracy" in r else "")
          + f"  {r['images_per_second']:,.0f} img/s ({r['images_per_second_per_rank']:,.0f}/rank)"
          f"  {r['epoch_seconds']:.1f} s  input wait {r['input_wait_share']:.1%}")
  if "parallel_efficiency" in r:
    text += f"  efficiency {r['parallel_efficiency']:.3f}"
  if r["skipped_steps"]:
    text += f"  {r['skipped_steps']} non-finite steps skipped"
  return text + ("  (includes compilation)" if compiled else "")


def optimizer_values(opt_state: Any, rate: optax.ScalarOrSchedule | None, step: int) -> dict:
  """The rate of the last step (``step - 1``, as optax counts) and a dynamic loss scale."""
  values = {} if rate is None else {"learning_rate": float(rate(step - 1) if callable(rate)
                                                           else rate)}
  with contextlib.suppress(ValueError):  # none (or several) in the optimizer: not recorded
    values["loss_scale"] = float(loss_scale_state(opt_state).scale)
  return values


def timeline_values(report: dict) -> dict:
  """An epoch record's fields from the timeline's straggler report (means over ranks)."""
  ranks = report["ranks"]
  return {"exchange_share": sum(r["exchange_share"] for r in ranks) / len(ranks),
          "wait_share": sum(r["wait_share"] for r in ranks) / len(ranks),
          "straggler_report": report}


def evaluation(state: TrainState, eval_batches: Callable[[], Iterable] | None,
               comm: Communicator) -> dict:
  """An epoch record's test fields: `evaluate` over ``eval_batches()`` (collective); none
  without evaluation batches."""
  if eval_batches is None:
    return {}
  test = evaluate(state, eval_batches(), comm)
  return {"test_loss": test["loss"], "test_accuracy": test["correct"],
          "test_count": test["count"]}
