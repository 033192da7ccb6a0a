"""``python -m lab.bench cluster``'s step part: train steps across emulated nodes, predicted
by the link's cost model before they are measured.

Per rate and node count: alpha and bandwidth of the link, fitted once from a job of float32
exchanges of 64 kB to 16 MB (`FIT`; `lab.costmodel.link.fit` with relative errors: a
step's buckets are small), then three jobs of `lab.bench.cluster_step_worker` (the
digits CNN and a ResNet-10, each against the same step with no cross-node exchange):

* ``flat``, 1 rank per node (the link alone): plain `allreduce_gradients`, the bf16 wire,
  backprop-order buckets that leave as soon as their leaves are ready, double buffering;
* ``flat``, 2 ranks per node, and ``hierarchical`` with 1 process x 2 devices per node:
  plain `allreduce_gradients`, the digits CNN only (`JOBS`).

A job that fails is reported (its error in the point's ``failed``) and the others still run.

Before each job its exchange is predicted per variant: every bucket the step sends (the
plan `allreduce_gradients` uses, `lab.costmodel.step.planned_buckets`) costs
``alpha + uplink bytes / bandwidth``. The measured exchange is the step's time minus the
no-exchange step's (same job, alternating rounds). Step efficiency = t(no exchange) /
t(variant), as in ``python -m lab.bench step``; predicted without overlap (``t0 / (t0 +
x)``) and fully overlapped (``t0 / max(t0, x)``). ``overlap`` = (t(plain) - t(variant)) /
min(t0, x(plain)): the share of the hideable time that was hidden (0: none, 1: all).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lab.bench.cluster_job import cluster_job
from lab.bench.cluster_step_worker import VARIANTS

# The link's fit: float32 exchanges of 64 kB to 16 MB, relative errors (the CNN's buckets are
# 5-520 kB, the ResNet's up to 9.4 MB).
FIT = (16_000, 62_500, 250_000, 1_000_000, 4_000_000)

# (kind, ranks per node, devices per rank, models, variants): the jobs of one point. The
# ResNet runs on the link alone: its per-rank BatchNorm differs across a process's devices
# (several devices would need SyncBatchNorm, another exchange), and each of its variants
# compiles for ~14 s alone on one core, more on the shared ones.
JOBS = (("flat", 1, None, ("cnn", "resnet"), tuple(VARIANTS)),
        ("flat", 2, None, ("cnn",), ("allreduce",)),
        ("hierarchical", 1, 2, ("cnn",), ("allreduce",)))


def predicted_exchange(fit, kind: str, buckets: list[float], *, nodes: int,
                       ranks_per_node: int, bf16: bool) -> float:
  """Seconds of one step's exchange: each bucket (wire bytes) ``alpha + bytes / bandwidth``.

  Example:
    >>> from lab.costmodel.link import LinkFit
    >>> predicted_exchange(LinkFit(1e-3, 1e8), "flat", [1e6, 1e6], nodes=2,
    ...                    ranks_per_node=1, bf16=False)
    0.022
  """
  scale, bits = (2, 16) if bf16 else (1, 32)
  return sum(fit.exchange_time(kind, scale * b, nodes=nodes, ranks_per_node=ranks_per_node,
                               wire_bits=bits) for b in buckets)


def overlap(plain_s: float, variant_s: float, no_exchange_s: float) -> float | None:
  """The share of the hideable time a variant hid: (plain step - variant step) / min(t0,
  plain exchange), the exchange being plain step - t0 (None when nothing can be hidden).

  Example:
    >>> round(overlap(0.30, 0.25, 0.10), 2)   # a 200 ms exchange, 100 ms step: 50 of 100 hidden
    0.5
    >>> round(overlap(0.30, 0.33, 0.10), 2), overlap(0.10, 0.10, 0.10)   # slower; nothing
    (-0.3, None)
  """
  hideable = min(no_exchange_s, plain_s - no_exchange_s)
  return (plain_s - variant_s) / hideable if hideable > 0 else None


def _job(kind, rpn, devices, models, variants, *, nodes, rate, args, folder) -> dict:
  out = Path(folder) / f"step-{kind}-{rpn}-{rate}-{nodes}.json"
  cluster_job(["lab.bench.cluster_step_worker", "--kind", kind, "--models", ",".join(models),
               "--variants", ",".join(variants), "--rounds", str(args.rounds), "--out",
               str(out)], nodes=nodes, rate=rate, ranks_per_node=rpn, devices=devices)
  return json.loads(out.read_text())


def step_point(nodes: int, rate: str, fit, args, folder) -> dict:
  """Predicted and measured rows of every job at one rate and node count."""
  from lab.bench.cluster_step_worker import bucket_plan
  rows, failed = [], []
  wanted = args.models.split(",")
  for kind, rpn, devices, models, variants in JOBS:
    models = [m for m in models if m in wanted]
    if not models:
      continue
    # Predicted first, from the plan alone (the function the worker records its plan with).
    # local SGD: the exchange once per every_k steps (plus one float per leaf).
    predicted = {m: {v: fit and predicted_exchange(
        fit, kind, bucket_plan(m, v), nodes=nodes, ranks_per_node=rpn,
        bf16="wire_dtype" in VARIANTS[v][0]) / VARIANTS[v][0].get("local_sgd", 1)
        for v in variants} for m in models}
    start = time.perf_counter()
    try:
      got = _job(kind, rpn, devices, models, variants, nodes=nodes, rate=rate, args=args,
                 folder=folder)
    except SystemExit as e:   # the others still run; the error is kept
      failed.append({"kind": kind, "ranks_per_node": rpn, "error": str(e)[-2000:]})
      print(f"step job {kind} x {rpn} per node failed: {str(e)[-600:]}", flush=True)
      continue
    print(f"  step job {kind}, {rpn} rank(s) x {devices or 1} device(s) per node, "
          f"{nodes} nodes: {time.perf_counter() - start:.0f} s", flush=True)
    for model, m in got["models"].items():
      sec = m["seconds_per_step"]
      t0 = sec["no_communication"]
      for v in variants:
        x = predicted[model][v]
        rows.append({
            "kind": kind, "ranks_per_node": rpn, "devices_per_rank": devices or 1,
            "model": model, "params": m["params"], "variant": v,
            "buckets": len(m["bucket_bytes"][v]), "step_s": sec[v], "no_exchange_s": t0,
            "exchange_s": max(sec[v] - t0, 0.0), "predicted_exchange_s": x,
            "efficiency": t0 / sec[v],
            "predicted_efficiency": x and t0 / (t0 + x),
            "predicted_efficiency_overlapped": x and t0 / max(t0, x)})
  for r in rows:
    plain = next(p for p in rows if (p["kind"], p["ranks_per_node"], p["model"], p["variant"])
                 == (r["kind"], r["ranks_per_node"], r["model"], "allreduce"))
    r["overlap"] = (overlap(plain["step_s"], r["step_s"], r["no_exchange_s"])
                    if r["variant"] in ("buckets_backprop_order", "double_buffering") else None)
  return {"rate": rate, "nodes": nodes, "alpha_s": fit and fit.alpha,
          "bandwidth_Bps": fit and fit.bandwidth, "rows": rows, "failed": failed}


def print_point(point: dict) -> None:
  fit = ("no fit" if point["alpha_s"] is None else
         f"fit alpha {point['alpha_s'] * 1e3:.1f} ms, bandwidth "
         f"{point['bandwidth_Bps'] * 8 / 1e9:.2f} Gbit/s")
  print(f"\n== steps at {point['rate']}, {point['nodes']} nodes: {fit}")
  print(f"{'kind':12} {'rpn':>3} {'dev':>3} {'model':6} {'variant':22} {'bkts':>4} "
        f"{'step ms':>8} {'t0 ms':>7} {'exch ms':>8} {'model':>7} {'meas/model':>10} "
        f"{'eff':>5} {'model':>5} {'ovlp':>5} {'overlap':>7}")
  for r in point["rows"]:
    x = r["predicted_exchange_s"]
    model = ("-", "-", "-", "-") if x is None else (
        f"{x * 1e3:.0f}", f"{r['exchange_s'] / x:.2f}", f"{r['predicted_efficiency']:.2f}",
        f"{r['predicted_efficiency_overlapped']:.2f}")
    hidden = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
    print(f"{r['kind']:12} {r['ranks_per_node']:3} {r['devices_per_rank']:3} {r['model']:6} "
          f"{r['variant']:22} {r['buckets']:4} {r['step_s'] * 1e3:8.1f} "
          f"{r['no_exchange_s'] * 1e3:7.1f} {r['exchange_s'] * 1e3:8.1f} {model[0]:>7} "
          f"{model[1]:>10} {r['efficiency']:5.2f} {model[2]:>5} {model[3]:>5} {hidden:>7}")
  for f in point["failed"]:
    print(f"  failed: {f['kind']} x {f['ranks_per_node']} per node: {f['error'][-300:]}")
  for model in dict.fromkeys(r["model"] for r in point["rows"]):
    mine = [r for r in point["rows"] if r["model"] == model]
    eff = ", ".join(f"{r['kind']} {r['ranks_per_node']}x{r['devices_per_rank']}/node "
                    f"{r['efficiency']:.2f}" for r in mine if r["variant"] == "allreduce")
    rest = ", ".join(f"{r['variant']} {r['efficiency']:.2f}" + (
        "" if r["overlap"] is None else f" (overlap {r['overlap']:.2f})")
        for r in mine if r["variant"] != "allreduce")
    print(f"  {model} step efficiency: {eff}; flat 1x1/node: {rest}")
