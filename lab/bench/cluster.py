"""Gradient exchange over shaped links between emulated nodes (`lab.cluster`), side by side.

    python -m lab.bench cluster                         # none, 1gbit, 10gbit x 2, 4 nodes
    python -m lab.bench cluster --rates 1gbit --nodes 2 --quick
    python -m lab.bench cluster --parts step            # train steps at 1gbit x 2, 4 nodes
    python -m lab.bench cluster --parts gap             # one exchange after idle or compute

Three parts (``--parts exchange,step,gap``; exchange and step by default). The gap part
(`gap_point`, at ``--step-rates``): the digits CNN's exchange alone at 1 and 2 ranks per
node, back to back, after idle and after compute. The step part (train steps of the
digits CNN and a ResNet-10 per layout: plain `allreduce_gradients`, the bf16 wire,
backprop-order buckets, double buffering and local SGD, each predicted by the link model
calibrated for its layout, at ``--step-rates``) is `lab.bench.cluster_step`'s. The
exchange part:

Needs root. Per rate (``none``: the unshaped ceiling of this box's veth/TCP) and node count,
four jobs, each `lab.bench.cluster_worker` under ``python -m lab.cluster run``:

* ``flat``, 1 rank per node (the link alone): float32 exchanges of 1, 4, 8 and 16 MB (the fit)
  and of ResNet-50's 102 MB gradient, fp32 and bf16 wire;
* ``flat``, 2 ranks per node (fp32, and bf16: the node-aware 16-bit wire); ``hierarchical``
  (fp32, bf16) and ``two_dimensional``, 1 process x 2 emulated devices per node: the 102 MB
  exchange.

The step exchanges a flat float32 vector and applies SGD; its cost without the exchange is
timed in the same job and subtracted: the exchange time. Alpha and bandwidth are fitted
(`lab.costmodel.link.fit`) on the 1-16 MB points only, then every 102 MB figure is
predicted from the uplink bytes the model gives (`uplink_bytes`), before it is compared.
Prints one table per rate and node count and writes ``runs/bench/cluster.json`` (all
parts: ``points``, ``step_points``, ``gap_points``; rewritten after every point).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

from lab.bench.cluster_job import cluster_job
from lab.costmodel import link

RESNET50 = 25_557_032          # float32 parameters: 102 MB
FIT = (250_000, 1_000_000, 2_000_000, 4_000_000)   # 1, 4, 8 and 16 MB


def _job(kind, sizes, wires, *, nodes, rate, ranks_per_node, devices, steps, folder,
         local_baseline=False, windows=0, before="none"):
  """The rows of one `lab.bench.cluster_worker` job: each exchange's time, the step's minus
  the no-exchange step's, or with `windows` the handlers' own (``exchange_step_s`` keeps
  the difference)."""
  out = Path(folder) / f"{kind}-{ranks_per_node}-{rate}-{nodes}.json"
  cluster_job(["lab.bench.cluster_worker", "--kind", kind, "--params",
               ",".join(map(str, sizes)), "--wire", ",".join(wires), "--baseline", "--steps",
               str(steps), "--out", str(out), "--handler-windows", str(windows),
               "--before", before,
               *(["--local-baseline"] if local_baseline else [])],
              nodes=nodes, rate=rate, ranks_per_node=ranks_per_node, devices=devices)
  runs = json.loads(out.read_text())["runs"]
  base = {(r["before"], r["params"]): r["seconds_per_step"] for r in runs if r["wire"] == "none"}
  rows = []
  for r in (r for r in runs if r["wire"] != "none"):
    step, alone = r["seconds_per_step"], base[r["before"], r["params"]]
    handlers, idle = r.get("handler_seconds_per_step"), r.get("handler_idle_seconds")
    rows.append({
        "kind": kind, "ranks_per_node": ranks_per_node, "before": r["before"],
        "params": r["params"],
        "wire": r["wire"], "exchange_s": max(step - alone, 0) if handlers is None else handlers,
        "exchange_step_s": max(step - alone, 0), "step_s": step,
        # The link's idle time before each exchange: from the handlers' events, or the step
        # without its exchange.
        "idle_s": alone if idle is None else idle,
        "tx_bytes": r["nodes"][0]["tx_bytes"] if r["nodes"] else None})
  return rows


def shaper(rate: str) -> dict:
  """The shaped uplink's ``burst`` (bytes it lets through at once, `lab.cluster.burst_bytes`)
  and ``refill`` (bytes/s its bucket refills at: the rate), as `link.fit` takes them; 0
  unshaped.

  Example:
    >>> shaper("1gbit"), shaper("none")
    ({'burst': 250000.0, 'refill': 125000000.0}, {'burst': 0.0, 'refill': 0.0})
  """
  from lab.cluster import burst_bytes, rate_bits
  bits = rate_bits(rate)
  if bits is None:
    return {"burst": 0.0, "refill": 0.0}
  return {"burst": float(burst_bytes(bits)), "refill": bits / 8}


def fit_link(rows, *, nodes, rate, kind="flat", ranks_per_node=1, wire="fp32", sizes=FIT,
             relative=False) -> link.LinkFit | None:
  """alpha and bandwidth from the rows (`_job`) of one layout and wire, of `sizes`
  (`link.fit` on each row's modelled uplink bytes, the shaper known from `rate`, each
  row's idle link before its exchange, ``idle_s``; with rows after idle beside rows back to
  back, also ``alpha_first`` from the former); None (and says why)
  where the link is not the bottleneck. By default the link alone: ``flat``, one rank per
  node, float32."""
  fits = [r for r in rows if r["kind"] == kind and r["ranks_per_node"] == ranks_per_node
          and r["wire"] == wire and r["params"] in sizes]
  bits = 16 if wire == "bf16" else 32
  # Rows after idle (``before`` sleep or compute) beside rows back to back: two alphas.
  first = [r.get("before", "none") != "none" for r in fits]
  try:
    return link.fit([link.uplink_bytes(kind, 4 * r["params"], nodes=nodes,
                                       ranks_per_node=ranks_per_node, wire_bits=bits)
                     for r in fits], [r["exchange_s"] for r in fits], relative=relative,
                    idle_s=[r["idle_s"] for r in fits],
                    first=first if len(set(first)) == 2 else None, **shaper(rate))
  except ValueError as e:   # the unshaped link: the cores, not the link, may set the time
    print(f"no link fit for {kind} x {ranks_per_node} per node ({wire}) at {rate}, {nodes} "
          f"nodes: {e}")
    return None


def fit_job(*, nodes, rate, steps, folder, kind="flat", ranks_per_node=1, devices=None,
            wires=("fp32",), sizes=FIT, relative=False, windows=3,
            before="none") -> tuple[dict, list[dict]]:
  """({wire: the fit or None}, the measured rows) from a job of one layout's exchanges of
  `sizes` float32 parameters alone: what the link and the box's shared cores (the
  reductions and copies of every rank on a node) cost that layout, calibrated once per
  point. Timed from the handlers' events (`windows` of `steps` steps,
  `lab.bench.handler_time`), as the step benchmark times its exchange rows; the baseline
  averages over each process's own devices, as the step benchmark's no-exchange step: the
  exchange is what crosses processes. `before`: the gaps each size is timed after
  (`lab.bench.cluster_worker.gap`; ``none,sleep``: back to back and after idle, two
  alphas)."""
  rows = _job(kind, sizes, list(wires), nodes=nodes, rate=rate, ranks_per_node=ranks_per_node,
              devices=devices, steps=steps, folder=folder, local_baseline=True, windows=windows,
              before=before)
  return {w: fit_link(rows, nodes=nodes, rate=rate, kind=kind, ranks_per_node=ranks_per_node,
                      wire=w, sizes=sizes, relative=relative) for w in wires}, rows


def _point(nodes, rate, steps, folder, big):
  rows = _job("flat", [*FIT, big], ["fp32", "bf16"], nodes=nodes, rate=rate,
              ranks_per_node=1, devices=None, steps=steps, folder=folder)
  rows += _job("flat", [big], ["fp32", "bf16"], nodes=nodes, rate=rate, ranks_per_node=2,
               devices=None, steps=steps, folder=folder)
  rows += _job("hierarchical", [big], ["fp32", "bf16"], nodes=nodes, rate=rate,
               ranks_per_node=1, devices=2, steps=steps, folder=folder)
  rows += _job("two_dimensional", [big], ["fp32"], nodes=nodes, rate=rate, ranks_per_node=1,
               devices=2, steps=steps, folder=folder)
  f = fit_link(rows, nodes=nodes, rate=rate)
  for r in rows:
    bits = 16 if r["wire"] == "bf16" else 32
    r["predicted_bytes"] = link.uplink_bytes(r["kind"], 4 * r["params"], nodes=nodes,
                                             ranks_per_node=r["ranks_per_node"], wire_bits=bits)
    r["predicted_s"] = f and f.exchange_time(r["kind"], 4 * r["params"], nodes=nodes,
                                             ranks_per_node=r["ranks_per_node"], wire_bits=bits,
                                             idle_s=r["idle_s"])
  return {"rate": rate, "nodes": nodes, "alpha_s": f and f.alpha,
          "bandwidth_Bps": f and f.bandwidth, "rows": rows}


GAP_PARAMS = 151_306   # the digits CNN's gradient, 605 kB: the step part's exchange rows'


def gap_point(nodes: int, rate: str, folder) -> dict:
  """The digits CNN's exchange alone, at 1 and 2 ranks per node: back to back, after 10 ms
  of idle, after 10 ms of compute on every rank with the ranks entering it together and
  as they come (`lab.bench.cluster_worker.gap`), timed from the handlers' events. What
  the shared cores add to an exchange that follows a step's compute, beside the link."""
  from lab.bench.cluster_worker import GAPS
  rows = []
  for rpn in (1, 2):
    rows += _job("flat", [GAP_PARAMS], ["fp32"], nodes=nodes, rate=rate, ranks_per_node=rpn,
                 devices=None, steps=8, folder=folder, windows=3, before=",".join(GAPS))
  return {"rate": rate, "nodes": nodes, "rows": rows}


def _print_gap(point):
  print(f"\n== the {4 * GAP_PARAMS / 1e3:.0f} kB exchange after ..., {point['rate']}, "
        f"{point['nodes']} nodes (handlers' ms; x: over the same after idle)")
  for rpn in sorted({r["ranks_per_node"] for r in point["rows"]}):
    mine = {r["before"]: r for r in point["rows"] if r["ranks_per_node"] == rpn}
    idle = mine["sleep"]["exchange_s"]
    print(f"  {rpn} rank(s) per node: " + ", ".join(
        f"{b} {r['exchange_s'] * 1e3:.2f} ({r['exchange_s'] / idle:.2f}x)"
        for b, r in mine.items()))


def _ratio(rows, a, b):
  def big(key):
    return next(r["exchange_s"] for r in rows
                if (r["kind"], r["ranks_per_node"], r["wire"]) == key and r["params"] > 4e6)
  ta, tb = big(a), big(b)
  return ta / tb if tb > 0 else float("nan")


def _print(point):
  fit = ("no fit" if point["alpha_s"] is None else
         f"fit alpha {point['alpha_s'] * 1e3:.1f} ms, bandwidth "
         f"{point['bandwidth_Bps'] * 8 / 1e9:.2f} Gbit/s (1-16 MB, flat, 1 rank per node)")
  print(f"\n== {point['rate']}, {point['nodes']} nodes: {fit}")
  print(f"{'kind':16} {'rpn':>3} {'wire':4} {'MB':>6} {'MB/node meas':>12} {'model':>7} "
        f"{'exchange ms':>11} {'model':>7} {'meas/model':>10}")
  for r in point["rows"]:
    mb = "-" if r["tx_bytes"] is None else f"{r['tx_bytes'] / 1e6:.1f}"
    pred = r["predicted_s"]
    model = ("-", "-") if pred is None else (f"{pred * 1e3:.0f}", f"{r['exchange_s'] / pred:.2f}")
    print(f"{r['kind']:16} {r['ranks_per_node']:3} {r['wire']:4} {4 * r['params'] / 1e6:6.0f} "
          f"{mb:>12} {r['predicted_bytes'] / 1e6:7.1f} {r['exchange_s'] * 1e3:11.0f} "
          f"{model[0]:>7} {model[1]:>10}")
  rows = point["rows"]
  point["ratios"] = {
      "hierarchical/flat(2 per node)": _ratio(rows, ("hierarchical", 1, "fp32"),
                                              ("flat", 2, "fp32")),
      "two_dimensional/flat(2 per node)": _ratio(rows, ("two_dimensional", 1, "fp32"),
                                                 ("flat", 2, "fp32")),
      "bf16/fp32 (flat, 1 per node)": _ratio(rows, ("flat", 1, "bf16"), ("flat", 1, "fp32")),
      "bf16/fp32 (flat, 2 per node)": _ratio(rows, ("flat", 2, "bf16"), ("flat", 2, "fp32")),
      "bf16/fp32 (hierarchical)": _ratio(rows, ("hierarchical", 1, "bf16"),
                                         ("hierarchical", 1, "fp32")),
  }
  print("  102 MB exchange: " + ", ".join(f"{k} {v:.2f}x" for k, v in point["ratios"].items()))


def main(argv: list[str]) -> None:
  p = argparse.ArgumentParser(prog="python -m lab.bench cluster",
                              description=__doc__.split("\n")[0])
  p.add_argument("--rates", default="none,1gbit,10gbit", help="tc rates per uplink, or none")
  p.add_argument("--nodes", default="2,4", help="node counts")
  p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
  p.add_argument("--quick", action="store_true", help="a 16 MB 'large' exchange instead of 102 MB")
  p.add_argument("--parts", default="exchange,step",
                 help="exchange (the flat-vector exchanges), step (train steps), gap (one "
                      "exchange after idle or compute)")
  p.add_argument("--step-rates", default="1gbit",
                 help="rates of the step part (10gbit is core-bound on 2 cores)")
  p.add_argument("--models", default="cnn,resnet", help="the step part's models: cnn, resnet")
  p.add_argument("--rounds", type=int, default=3, help="the step part's timed rounds")
  p.add_argument("--fit-before", default=None,
                 help="the gaps the step part's link fit times each size after (default "
                      "none,sleep: lab.bench.cluster_step.FIT_BEFORE; every gap but none "
                      "counts as after idle, for alpha_first)")
  p.add_argument("--out", default="runs/bench/cluster.json")
  args = p.parse_args(argv)
  parts = set(args.parts.split(","))
  if not parts or not parts <= {"exchange", "step", "gap"}:
    raise SystemExit(f"--parts: exchange, step and/or gap, got {args.parts!r}")
  from lab.bench.cluster_worker import GAPS
  if args.fit_before is not None and not set(args.fit_before.split(",")) <= set(GAPS):
    raise SystemExit(f"--fit-before: one or more of {', '.join(GAPS)}, got {args.fit_before!r}")
  from lab.cluster import ClusterError, check_available
  try:
    check_available()
  except ClusterError as e:
    raise SystemExit(f"python -m lab.bench cluster: {e}") from None
  from lab.bench import cluster_step
  big = 4_000_001 if args.quick else RESNET50
  node_counts = [int(n) for n in args.nodes.split(",")]
  points, step_points, gap_points, load = [], [], [], [os.getloadavg()[0]]
  with tempfile.TemporaryDirectory(prefix="mnjax-bench-cluster-") as folder:
    if "exchange" in parts:
      for rate in args.rates.split(","):
        for nodes in node_counts:
          points.append(_point(nodes, rate, args.steps, folder, big))
          _print(points[-1])
    if "step" in parts:
      for rate in args.step_rates.split(","):
        for nodes in node_counts:
          fit = functools.partial(fit_job, nodes=nodes, rate=rate, folder=folder,
                                  steps=cluster_step.FIT_STEPS, sizes=cluster_step.FIT,
                                  relative=True,
                                  before=args.fit_before or cluster_step.FIT_BEFORE)
          step_points.append(cluster_step.step_point(nodes, rate, fit, args, folder))
          cluster_step.print_point(step_points[-1])
          _write(args.out, points, step_points, gap_points, argv, load)   # as it comes
    if "gap" in parts:
      for rate in args.step_rates.split(","):
        for nodes in node_counts:
          gap_points.append(gap_point(nodes, rate, folder))
          _print_gap(gap_points[-1])
          _write(args.out, points, step_points, gap_points, argv, load)
  load.append(os.getloadavg()[0])
  _write(args.out, points, step_points, gap_points, argv, load)
  print(f"\nload average (1 min) {load[0]:.1f} -> {load[1]:.1f}; wrote {args.out}")


def _write(out, points, step_points, gap_points, argv, load):
  Path(out).parent.mkdir(parents=True, exist_ok=True)
  Path(out).write_text(json.dumps(
      {"points": points, "step_points": step_points, "gap_points": gap_points,
       "command": ["python", "-m", "lab.bench",
       "cluster", *argv], "load_average_1min": [round(x, 2) for x in load]}, indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
