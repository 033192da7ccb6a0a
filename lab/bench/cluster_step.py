"""``python -m lab.bench cluster``'s step part: train steps across emulated nodes, their
exchanges predicted by the link's cost model and measured.

Per rate and node count, three jobs of `lab.bench.cluster_step_worker` (the digits CNN and a
ResNet-10, each against the same step with no cross-node exchange, `JOBS`):

* ``flat``, 1 rank per node (the link alone) and 2 ranks per node: plain
  `allreduce_gradients`, the bf16 wire (node-aware with 2 ranks per node), backprop-order
  buckets that leave as soon as their leaves are ready, double buffering, local SGD
  (every_k=8); the ResNet on the link alone only;
* ``hierarchical`` with 1 process x 2 devices per node: plain `allreduce_gradients`.

A job that fails is reported (its error in the point's ``failed``) and the others still run.

The model is calibrated once per job's layout, before the job: a job of float32 (and, where a
variant uses it, bf16-wire) exchanges of 64 kB to 16 MB in that layout (`FIT`), each size
back to back and after 10 ms of idle (`FIT_BEFORE`), fitted by `lab.costmodel.link.fit`
with relative errors (a step's buckets are small; the shaper's burst and refill rate known
from the rate, each point's idle link before it from the handlers' events). It gives
``alpha_first`` (an exchange after idle, as a step's first after its compute), ``alpha``
(one back to back, as a step's later buckets) and an effective bandwidth that includes
what the box's shared cores add to the link (the reductions and copies of every rank of
a node). Each variant's exchange is then
predicted from its bucket plan (the plan `allreduce_gradients` uses,
`lab.costmodel.step.planned_buckets`) and the time the link idles while the step computes
(the no-exchange step's time, the one input the job gives: the shaper's bucket refills
then): ``LinkFit.buckets_time``, buckets in flight together on ``flat`` without a wire
(``alpha_first`` once), one after the other elsewhere (``alpha_first``, then ``alpha``
each); local SGD's every ``every_k`` steps. The
exchange rows, where the model claims the time (`EXCHANGE_ROWS`:
nothing overlaps), are timed as the fit is, from the in-step handlers' own events
(`lab.bench.handler_time`: each collective from its last arrival to its last completion), and
compared to it; ``exchange_step_s`` keeps the step's time minus the no-exchange step's
(same job, alternating rounds), which also holds the ranks' skew. The overlapping variants lie
between the model without overlap and fully overlapped. Step efficiency = t(no exchange) /
t(variant), as in ``python -m lab.bench step``; predicted without overlap (``t0 / (t0 + x)``)
and fully overlapped (``t0 / max(t0, x)``). ``overlap`` = (t(plain) - t(variant)) / min(t0,
x(plain)): the share of the hideable time that was hidden (0: none, 1: all).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lab.bench.cluster_job import cluster_job
from lab.bench.cluster_step_worker import EXCHANGE_ROWS, NEVER, VARIANTS

# The link's fit: float32 exchanges of 64 kB to 16 MB, relative errors (the CNN's buckets are
# 5-520 kB, the ResNet's up to 9.4 MB).
FIT = (16_000, 62_500, 250_000, 1_000_000, 4_000_000)
FIT_STEPS = 10   # timed steps per size: the small exchanges are a few ms, noisy alone
# Each size back to back and after 10 ms of idle: a step's first exchange follows its
# compute (`LinkFit.alpha_first`), its later buckets follow one another (`alpha`).
FIT_BEFORE = "none,sleep"

# (kind, ranks per node, devices per rank, models, variants): the jobs of one point. The
# ResNet runs on the link alone: its per-rank BatchNorm differs across a process's devices
# (several devices would need SyncBatchNorm, another exchange), and each of its variants
# compiles for ~14 s alone on one core, more on the shared ones.
JOBS = (("flat", 1, None, ("cnn", "resnet"), tuple(VARIANTS)),
        ("flat", 2, None, ("cnn",), tuple(VARIANTS)),
        ("hierarchical", 1, 2, ("cnn",), ("allreduce",)))


def predicted_exchange(fits, kind: str, variant: str, buckets: list[float], *, nodes: int,
                       ranks_per_node: int, compute_s: float | None = None) -> float | None:
  """Seconds of one step's exchange of `buckets` (wire bytes) under `variant`, from the
  layout's `fits` ({"fp32" | "bf16": LinkFit or None}): `LinkFit.buckets_time` after
  `compute_s` of idle link (the step without its exchange; local SGD's ``every_k`` of them),
  divided by local SGD's ``every_k``; None without a fit, or for local SGD that never meets.

  Example:
    >>> from lab.costmodel.link import LinkFit
    >>> fits = {"fp32": LinkFit(1e-3, 1e8), "bf16": LinkFit(2e-3, 1e8)}
    >>> [round(predicted_exchange(fits, "flat", v, [1e6, 1e6], nodes=2, ranks_per_node=1), 4)
    ...  for v in ("allreduce", "allreduce_bf16_wire", "local_sgd8")]
    [0.021, 0.024, 0.0026]
  """
  options = VARIANTS[variant][0]
  bf16 = "wire_dtype" in options
  fit = fits.get("bf16" if bf16 else "fp32")
  if fit is None or options.get("local_sgd") == NEVER:   # no fit; no exchange while timed
    return None
  every_k = options.get("local_sgd", 1)
  float32 = [2 * b for b in buckets] if bf16 else list(buckets)
  x = fit.buckets_time(kind, float32, nodes=nodes, ranks_per_node=ranks_per_node,
                       wire_bits=16 if bf16 else 32, in_flight=kind == "flat" and not bf16,
                       idle_s=None if compute_s is None else every_k * compute_s)
  return x / every_k


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


def step_point(nodes: int, rate: str, fit_layout, args, folder) -> dict:
  """Predicted and measured rows of every job at one rate and node count. `fit_layout(kind=,
  ranks_per_node=, devices=, wires=)` calibrates the model for a job's layout
  (({wire: LinkFit or None}, measured rows); `lab.bench.cluster.fit_job`)."""
  from lab.bench.cluster_step_worker import bucket_plan
  rows, failed, fits_of = [], [], {}
  wanted = args.models.split(",")
  for kind, rpn, devices, models, variants in JOBS:
    models = [m for m in models if m in wanted]
    if not models:
      continue
    wires = ("fp32", "bf16") if "allreduce_bf16_wire" in variants else ("fp32",)
    try:
      fits, measured = fit_layout(kind=kind, ranks_per_node=rpn, devices=devices, wires=wires)
    except SystemExit as e:   # no model for this layout; its steps are still measured
      print(f"fit job {kind} x {rpn} per node failed: {str(e)[-600:]}", flush=True)
      fits, measured = {}, []
    # The measured points are kept with or without a fit: where none came, they say why.
    fits_of[f"{kind} {rpn}x{devices or 1}"] = {w: {
        **({} if f is None else {"alpha_s": f.alpha, "alpha_first_s": f.alpha_first,
                                 "bandwidth_Bps": f.bandwidth, "burst_bytes": f.burst,
                                 "refill_Bps": f.refill}),
        "points": [(r["params"], r["exchange_s"], r["idle_s"], r["before"])
                   for r in measured if r["wire"] == w]}
        for w, f in fits.items()}
    plans = {m: {v: bucket_plan(m, v) for v in variants} for m in models}
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
        # From the fit, the plan and the step without exchange alone (the shaper's bucket
        # refills while it computes): not from this variant's own times.
        x = predicted_exchange(fits, kind, v, plans[model][v], nodes=nodes,
                               ranks_per_node=rpn, compute_s=t0)
        # local SGD's exchange: against the same transformation that never meets (its own
        # per-step work is not an exchange), where that ran.
        base = sec.get("local_sgd_alone", t0) if v == "local_sgd8" else t0
        step_diff = max(sec[v] - base, 0.0)
        rows.append({
            "kind": kind, "ranks_per_node": rpn, "devices_per_rank": devices or 1,
            "model": model, "params": m["params"], "variant": v,
            "buckets": len(m["bucket_bytes"][v]), "step_s": sec[v], "no_exchange_s": t0,
            "exchange_s": m.get("exchange_seconds", {}).get(v, step_diff),
            "exchange_step_s": step_diff, "predicted_exchange_s": x,
            "efficiency": t0 / sec[v],
            "predicted_efficiency": x and t0 / (t0 + x),
            "predicted_efficiency_overlapped": x and t0 / max(t0, x)})
  for r in rows:
    plain = next(p for p in rows if (p["kind"], p["ranks_per_node"], p["model"], p["variant"])
                 == (r["kind"], r["ranks_per_node"], r["model"], "allreduce"))
    r["overlap"] = (overlap(plain["step_s"], r["step_s"], r["no_exchange_s"])
                    if r["variant"] in ("buckets_backprop_order", "double_buffering") else None)
  alone = fits_of.get("flat 1x1", {}).get("fp32", {})
  return {"rate": rate, "nodes": nodes, "alpha_s": alone.get("alpha_s"),
          "bandwidth_Bps": alone.get("bandwidth_Bps"), "fits": fits_of, "rows": rows,
          "failed": failed}


def within(rows, tolerance: float = 0.15) -> tuple[int, int]:
  """(exchange rows whose measured exchange is within `tolerance` of the model's, exchange
  rows with a model): the model's claim, checked.

  Example:
    >>> rows = [{"variant": "allreduce", "exchange_s": 1.1, "predicted_exchange_s": 1.0},
    ...         {"variant": "local_sgd8", "exchange_s": 0.5, "predicted_exchange_s": 1.0},
    ...         {"variant": "double_buffering", "exchange_s": 0.5, "predicted_exchange_s": 1.0}]
    >>> within(rows)
    (1, 2)
  """
  mine = [r for r in rows if r["variant"] in EXCHANGE_ROWS and r["predicted_exchange_s"]]
  good = [r for r in mine if abs(r["exchange_s"] / r["predicted_exchange_s"] - 1) <= tolerance]
  return len(good), len(mine)


def print_point(point: dict) -> None:
  def alphas(f):
    first = f.get("alpha_first_s")
    return f"alpha {f['alpha_s'] * 1e3:.1f} ms" + ("" if first is None else
                                                   f" (first {first * 1e3:.1f})")
  fits = "; ".join(f"{layout} {w}: " + ("none" if "alpha_s" not in f else
                   f"{alphas(f)}, {f['bandwidth_Bps'] * 8 / 1e9:.2f} Gbit/s")
                   for layout, by_wire in point["fits"].items() for w, f in by_wire.items())
  good, rows = within(point["rows"])
  print(f"\n== steps at {point['rate']}, {point['nodes']} nodes: fits {fits}; exchange rows "
        f"within 15% of the model: {good} of {rows}")
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
    for layout in dict.fromkeys((r["kind"], r["ranks_per_node"], r["devices_per_rank"])
                                for r in mine):
      here = [r for r in mine if (r["kind"], r["ranks_per_node"], r["devices_per_rank"])
              == layout]
      print(f"  {model}, {layout[0]} {layout[1]}x{layout[2]}/node, step efficiency: " + ", ".join(
          f"{r['variant']} {r['efficiency']:.2f}" + (
              "" if r["overlap"] is None else f" (overlap {r['overlap']:.2f})") for r in here))
