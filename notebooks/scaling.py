# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Scaling: what we measure here, and what the cost model predicts out to 1024 GPUs
#
# No machine of this project has more than two CPU cores, so the road to 128-1024 GPUs is a
# cost model (`lab.costmodel`): alpha-beta models of the allreduce algorithms behind each
# communicator kind, a step-time model with overlap, wire dtype and bucketing, calibrated on
# what `python -m lab.bench` measures here and **validated against published results
# before it predicts anything**.
#
# This notebook
# 1. loads (or, with `MNJAX_RUN_BENCHMARKS=1`, runs) the benchmarks: allreduce time per
#    message size per method, and the digits step at 1..N ranks;
# 2. fits the model's latency, bandwidth and mnjax's software overhead to them;
# 3. checks the model against ChainerMN, Goyal et al. and Horovod;
# 4. predicts the efficiency of every communicator kind from 8 to 1024 GPUs on an MN-1-like
#    cluster and on a modern H200 + NDR cluster.
#
# Figures go to `notebooks/figures/` (`MNJAX_FIGURES` overrides it). `MNJAX_NOTEBOOK_SMOKE=1`
# is CI's quick run: the same cells on fewer points.

# %%
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

sys.path.insert(0, str(Path.cwd().parent))  # lab/ lives beside notebooks/ in the checkout

from lab import costmodel as cm
from lab.costmodel import allreduce as ar
from lab.costmodel import hardware as hw
from lab.costmodel import published, step

REPO = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
SMOKE = os.environ.get("MNJAX_NOTEBOOK_SMOKE") == "1"
RUN = os.environ.get("MNJAX_RUN_BENCHMARKS") == "1"
FIGURES = Path(os.environ.get("MNJAX_FIGURES", REPO / "notebooks" / "figures"))
FIGURES.mkdir(parents=True, exist_ok=True)


def save(fig, name):
  path = FIGURES / f"{name}.png"
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")

# %% [markdown]
# ## 1. The benchmarks
#
# Committed results live in `docs/results/bench/` (measured on this project's 2-core
# machine, `mpirun --bind-to core`). `MNJAX_RUN_BENCHMARKS=1` measures afresh into `runs/bench/`:
#
# ```
# python -m lab.bench allreduce          # 4 B - 128 MB, every method, 2 ranks (~10 min)
# python -m lab.bench scaling            # digits step at 1, 2, 3, 4 ranks (~5 min)
# ```

# %%
RESULTS = REPO / "docs" / "results" / "bench"
if RUN:
  for bench, extra in (("allreduce", ["--no_psum"]), ("scaling", [])):
    if SMOKE:
      extra += (["--max_bytes", "7e7", "--rounds", "1", "--seconds", "0.01"]
                if bench == "allreduce" else ["--ranks", "1", "2", "--steps", "3", "--rounds", "1"])
    subprocess.run([sys.executable, "-m", "lab.bench", bench, *extra,
                    "--out", str(REPO / "runs" / "bench" / f"{bench}.json")], check=True, cwd=REPO)
  RESULTS = REPO / "runs" / "bench"
allreduce_json = json.loads((RESULTS / "allreduce.json").read_text())
scaling_json = json.loads((RESULTS / "scaling.json").read_text())
print(f"loaded allreduce.json and scaling.json from {RESULTS.relative_to(REPO)}/")

# %% [markdown]
# ## 2. Allreduce bandwidth against message size, and the calibrated model
#
# Bus bandwidth is NCCL's convention, `2 (p-1)/p · n / t`: the link rate a ring would need.
# The model's link for this machine is fitted to raw MPI: latency `alpha` from messages up to
# 1 kB, bandwidth from 32 MB up (gradient sizes; in between, the CPU caches make shared-memory
# MPI faster than either regime). mnjax's own overhead is what it adds to raw MPI: a cost per
# call and the packing of leaves into buckets.

# %%
cal = cm.calibrate.from_allreduce_json(allreduce_json)
ranks = allreduce_json["mpi"]["ranks"]
sweep = allreduce_json["mpi"]["sweep"]
sizes = [row["bytes"] for row in sweep]
methods = ["raw_mpi", "mpi4jax", "mnjax_fp32", "mnjax_bf16", "mnjax_fp16"]
fig, ax = plt.subplots(figsize=(8, 4.5))
for m in methods:
  ax.plot(sizes, [ar.bus_bandwidth(n, row["seconds"][m], ranks) / 1e9
                  for n, row in zip(sizes, sweep)], "o-", label=m, ms=4)
if "psum" in allreduce_json:
  ps = allreduce_json["psum"]["sweep"]
  ax.plot([r["bytes"] for r in ps],
          [ar.bus_bandwidth(r["bytes"], r["seconds"]["jax_psum"], ranks) / 1e9 for r in ps],
          "o-", label="jax_psum (gloo)", ms=4)
machine = cal.cluster(ranks)
ax.plot(sizes, [ar.bus_bandwidth(n, ar.ring(n, machine), ranks) / 1e9 for n in sizes], "k--",
        label=f"model: alpha {cal.raw_link.latency * 1e6:.1f} us,"
              f" B {cal.raw_link.bandwidth / 1e9:.2f} GB/s")
ax.set(xscale="log", yscale="log", xlabel="message (bytes, float32)",
       ylabel="bus bandwidth (GB/s)",
       title=f"allreduce on this machine, {ranks} ranks ({allreduce_json['launch']})")
ax.legend(fontsize=8)
save(fig, "allreduce_bandwidth")
print(f"mnjax software overhead: {cal.software.per_call * 1e6:.1f} us per call, packing at "
      f"{(cal.software.pack_bandwidth or float('inf')) / 1e9:.2f} GB/s")

# %% [markdown]
# ## 3. Measured efficiency at 1..N ranks, and the model for this machine
#
# Communication efficiency is the step time without communication over the step time with
# `allreduce_gradients`, measured in alternating rounds of one run. The model predicts it
# from the measured no-communication step, the digits CNN's gradient (151k float32, one
# bucket), and the calibrated link and overhead. Above 2 ranks the ranks share the 2 cores:
# weak scaling there measures the machine, not mnjax.

# %%
rows = scaling_json["rows"]
cnn = step.Workload("digits CNN", scaling_json["params"], compute=1.0)
predicted = [
    step.efficiency(cnn.replace(compute=r["seconds_no_communication"]), cal.cluster(r["ranks"]),
                    "flat", software=cal.software)
    for r in rows]
fig, ax = plt.subplots(figsize=(6, 4))
p = [r["ranks"] for r in rows]
ax.plot(p, [r["communication_efficiency"] for r in rows], "o-",
        label="measured: communication efficiency")
ax.plot(p, [r["weak_scaling_efficiency"] for r in rows], "s-", label="measured: weak scaling")
ax.plot(p, predicted, "k--", label="model: communication efficiency")
ax.set(xlabel="ranks (processes)", ylabel="efficiency", ylim=(0, 1.1), xticks=p,
       title="digits CNN step on this 2-core machine")
ax.legend(fontsize=8)
save(fig, "measured_efficiency")
display(Markdown(
    "| ranks | measured comm. efficiency | model | weak scaling |\n|---|---|---|---|\n"
    + "\n".join(f"| {r['ranks']} | {r['communication_efficiency']:.3f} | {m:.3f}"
                f" | {r['weak_scaling_efficiency']:.3f} |" for r, m in zip(rows, predicted))))

# %% [markdown]
# ## 4. The formulas, with their sources
#
# For `p` ranks, `n` bytes, link latency `α` and time per byte `β = 1/B` (Hockney's model):
#
# - **ring**: `2(p-1) α + 2 (p-1)/p · n β` (Patarasuk & Yuan, JPDC 2009)
# - **recursive halving/doubling**: `2 log2(p) α + 2 (p-1)/p · n β`, plus 2 full exchanges
#   if p is not a power of 2 (Thakur, Rabenseifner, Gropp, IJHPCA 2005)
# - **recursive doubling**: `log2(p) (α + n β)` (same)
# - **hierarchical**: `k · ring_node(n) + allreduce_nodes(n)` (mnjax: k = 2 intra-node
#   psums; ChainerMN: reduce + bcast, k ≈ 1) (ChainerMN, Akiba et al. 2017)
# - **two-dimensional**: `ring_node(n) + allreduce_nodes(n/g)`, the g shards sharing the
#   node's NICs (ChainerMN; Mikami et al. 2018, 2D-torus)
# - **double binary tree (NCCL >= 2.4)**: `2(g-1) α_node + 2 ceil(log2 N) α_net + 2n /
#   min(B_node, NICs · B_net)`, pipelined (Sanders, Speck & Träff 2009; NVIDIA's NCCL 2.4
#   blog)
#
# mnjax's kinds: `flat` is MPI_Allreduce over one process per GPU (MPICH: halving/doubling
# for large messages; with ranks placed by node its network steps carry messages already
# divided by the GPUs per node); `hierarchical` crosses the network from one GPU per node,
# on one NIC; `two_dimensional` from every GPU, on every NIC; `xla` is NCCL, the faster of
# its ring striped over every NIC and its double binary tree (NCCL's tuner picks per size).
#
# Step time: `compute + comm` without overlap; with overlap, buckets become ready evenly over
# the backward pass and go out one after another; with double buffering, `max(compute, comm)`.
# Overlapped communication still costs a fraction `interference` of its time (memory, PCIe
# and host contention). Efficiency is weak-scaling: step(1 GPU) / step(p GPUs).

# %% [markdown]
# ## 5. Validation: published points before predictions
#
# Each case's inputs and their sources are in `lab/costmodel/published.py`;
# `tests/unit/test_costmodel.py` fails when a prediction leaves its tolerance.

# %%
rows_v = published.validate()
display(Markdown(
    "| case | published | mnjax model | tolerance | ok |\n|---|---|---|---|---|\n"
    + "\n".join(f"| {r.name} ({r.source}) | {r.published} | {r.predicted:.3f}"
                f" | {r.low}-{r.high} | {'yes' if r.ok else '**no**'} |" for r in rows_v)))
assert all(r.ok for r in rows_v)

# %% [markdown]
# How much the two assumed inputs move the predictions: the ChainerMN step time (70-100
# images/s on a TITAN X) and the overlap `interference` (0 = perfect overlap).

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
computes = [0.30, 0.34, 0.37, 0.40, 0.46]
a1.plot(computes, [published.chainermn_2017(c) for c in computes], "o-")
a1.axhspan(0.78, 0.90, color="g", alpha=0.15, label="published 78-90%")
a1.set(xlabel="assumed step compute (s, 32 img/GPU)", ylabel="efficiency at 128 GPUs",
       title="ChainerMN 2017")
a1.legend(fontsize=8)
kappas = [0.0, 0.1, 0.2, 0.3, 0.4]
a2.plot(kappas, [published.goyal_2017(k) for k in kappas], "o-", label="Goyal et al. (pub. ~90%)")
a2.plot(kappas, [published.horovod_2018(k) for k in kappas], "s-", label="Horovod (pub. 88%)")
a2.axvline(published.INTERFERENCE, color="k", ls=":", label="value used")
a2.set(xlabel="interference", ylabel="efficiency", title="overlap cost")
a2.legend(fontsize=8)
save(fig, "validation_sensitivity")

# %% [markdown]
# ## 6. Predictions: every communicator kind, 8 to 1024 GPUs
#
# ResNet-50 (25.6M parameters, fp32 gradient, one bucket, no overlap: mnjax's jitted step
# today) at 32 images per GPU. Step compute, assumed: 0.17 s on a P100 (fp32, ~190
# images/s) for MN-1, 0.012 s on an H200 (bf16, ~2,700 images/s) for the H200 cluster. The
# dashed lines are `two_dimensional` with a bf16 wire and with overlap.

# %%
GPUS = [8, 16, 32, 64, 128, 256, 512, 1024] if not SMOKE else [8, 64, 1024]
KINDS = ("flat", "hierarchical", "two_dimensional", "xla")
setups = {
    "mn_1": step.RESNET50.replace(compute=0.17),
    "h200_ndr": step.RESNET50.replace(compute=0.012),
}


def gpu_axis(ax, base, w):
  """A predicted-efficiency panel: log GPU axis, the cluster and the step's compute."""
  ax.set(xscale="log", xlabel="GPUs", title=f"{base.name}: ResNet-50, {w.compute * 1e3:.0f} ms")
  ax.set_xticks(GPUS, [str(g) for g in GPUS])
  ax.grid(alpha=0.3)


def finish(fig, axes, name, **legend):
  axes[0].set_ylabel("predicted weak-scaling efficiency")
  axes[0].set_ylim(0, 1.02)
  axes[1].legend(loc="lower left", **legend)
  save(fig, name)


fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
table = {}
for ax, (preset, w) in zip(axes, setups.items()):
  base = hw.cluster(preset)
  curves = step.scaling(w, base, KINDS, GPUS)
  for kind, effs in curves.items():
    ax.plot(GPUS, effs, "o-", label=kind, ms=4)
    table[(preset, kind)] = effs
  for label, opts in (("two_dimensional, bf16 wire", {"wire_bytes": 2}),
                      ("two_dimensional, overlap", {"overlap": "backward", "bucket_bytes": 25 << 20,
                                                     "interference": published.INTERFERENCE})):
    effs = step.scaling(w, base, ("two_dimensional",), GPUS, **opts)["two_dimensional"]
    ax.plot(GPUS, effs, "--", label=label)
    table[(preset, label)] = effs
  gpu_axis(ax, base, w)
finish(fig, axes, "predicted_efficiency", fontsize=8)
display(Markdown("| cluster | kind | " + " | ".join(str(g) for g in GPUS) + " |\n|---|---|"
                 + "---|" * len(GPUS) + "\n" + "\n".join(
    f"| {preset} | {kind} | " + " | ".join(f"{e:.2f}" for e in effs) + " |"
    for (preset, kind), effs in table.items())))

# %%
at = GPUS[-1]
for preset in setups:
  effs = {kind: table[(preset, kind)][-1] for kind in KINDS}
  best = max(effs, key=effs.get)
  print(f"{preset} at {at} GPUs: " + ", ".join(f"{k} {e:.2f}" for k, e in effs.items())
        + f"; best: {best}")

# %% [markdown]
# Reading the predictions (the numbers are printed above):
#
# * `flat` (halving/doubling with ranks placed by node) and `two_dimensional` coincide: both
#   send `2 (N-1)/N · n` bytes per node over all of its NICs; `flat`'s line lies under
#   `two_dimensional`'s.
# * `hierarchical` loses most on both clusters: it runs two intra-node allreduces and crosses
#   the network from one GPU per node, on one NIC (one of two on MN-1, one of eight on H200).
# * NCCL (`xla`) uses every NIC; its ring alone would pay `2 (p-1)` latencies and fall
#   behind at 512-1024 GPUs, but its tree pays `2 log2(nodes)`, so `xla` stays the best kind
#   at scale. The model leaves out NCCL's protocols and SM limits: an upper estimate.
# * A bf16 wire halves the bandwidth term; overlap hides what the backward pass can cover.
#   With a 12 ms step, what limits a 1024-H200 job is latency and the exposed allreduce, not
#   the links' bandwidth.

# %% [markdown]
# ## 7. Overlap: each kind with and without it
#
# mnjax has two ways to hide the exchange behind the step (issue 16). **Backprop-order
# buckets**: the output layer's bucket leaves first and no bucket waits for the whole
# backward pass (mnjax's default on GPUs without `SyncBatchNorm`; with it, the MPI kinds
# start after its last backward collective: model that as "none"). **Double buffering**
# (`create_multi_node_optimizer(tx, comm, double_buffering=True)`): the previous step's
# gradient travels during this step, one step stale. The buckets are mnjax's own plan for
# ResNet-50's gradient at the GPU default of 4 MiB (`step.planned_buckets`), and overlapped
# communication costs `published.INTERFERENCE` of itself (fitted on Goyal et al. and
# Horovod).

# %%
import jax

from lab.models import ResNet50

image = jax.numpy.zeros((1, 224, 224, 3))
shapes = jax.eval_shape(lambda: ResNet50().init(jax.random.key(0), image, train=False))["params"]
sizes = step.planned_buckets(shapes, 4 << 20)
print(f"ResNet-50: {len(sizes)} buckets of at most 4 MiB, {sum(sizes) / 2**20:.1f} MiB in all")
OVERLAP_STYLES = {"none": "o-", "backward": "s--", "double_buffering": "^:"}
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
overlap_table = {}
for ax, (preset, w) in zip(axes, setups.items()):
  base = hw.cluster(preset)
  for kind, color in zip(KINDS, ("C0", "C1", "C2", "C3")):
    for overlap, style in OVERLAP_STYLES.items():
      effs = step.scaling(w, base, (kind,), GPUS, overlap=overlap, bucket_sizes=sizes,
                          interference=published.INTERFERENCE)[kind]
      ax.plot(GPUS, effs, style, color=color, ms=3, label=f"{kind}, {overlap}")
      overlap_table[(preset, kind, overlap)] = effs
  gpu_axis(ax, base, w)
finish(fig, axes, "predicted_overlap", fontsize=7, ncol=2)
display(Markdown(f"At {GPUS[-1]} GPUs:\n\n| cluster | kind | none | backward | double buffering |"
                 "\n|---|---|---|---|---|\n" + "\n".join(
    f"| {preset} | {kind} | " + " | ".join(
        f"{overlap_table[(preset, kind, o)][-1]:.3f}" for o in OVERLAP_STYLES) + " |"
    for preset in setups for kind in KINDS)))

# %% [markdown]
# Both modes hide most of the exchange where a step's compute covers it: on the H200 cluster
# a 12 ms step leaves little to hide behind, and double buffering (the whole step, not only
# the backward pass, covers the exchange) gains most. Measured here: on shared memory, one
# core per rank, nothing overlaps (docs/results/step.md); across emulated nodes on a 1 Gbit/s
# link, where the wait is on the link, double buffering took 0.80x plain's step with the
# exchange about half the compute (section 9, docs/results/cluster.md).

# %% [markdown]
# ## 8. From the compiler: ResNet-50 compiled for 8 H200
#
# `python -m lab.bench aot` (the CUDA plugin's venv, no GPU: `docs/results/aot.md`) compiles
# the experiments' step for 8 H200 and reads what the sections above assume: the **compute**
# per step from XLA's cost analysis (flops over the TF32 peak and bytes over HBM bandwidth, the
# larger of the two: a roofline lower bound, `lab.costmodel.compiled`), and the **overlap**
# from the compiled schedule (the share of the gradient bytes whose all-reduce XLA scheduled
# beside compute), with the all-reduces as XLA combined them. Solid: the compiled overlap;
# dashed: none of it hidden; dotted: section 7's assumed backprop overlap with the same compute.

# %%
from lab.costmodel import compiled as cc

aot_json = json.loads((REPO / "docs" / "results" / "bench" / "aot.json").read_text())
node = next(iter(aot_json["targets"].values()))
compiled_rows = {"mnjax, SyncBatchNorm": node["xla"]["sync_bn_allreduce_fp32"],
                 "mnjax, double buffering": node["xla"]["sync_bn_double_buffering_fp32"],
                 "plain jax.jit": node["plain_jax"]}
base = hw.cluster("h200_ndr")
fig, ax = plt.subplots(figsize=(7, 4.2))
lines = []
for (label, r), color in zip(compiled_rows.items(), ("C0", "C1", "C2")):
  t = cc.compute_time(r["flops"], r["bytes_accessed"], "H200")
  allreduces = [g["gradient_bytes"] for g in r["gradient_allreduces"]]  # as XLA combined them
  effs = cc.predict(t.seconds, allreduces, r["overlap"], base, GPUS,
                    interference=published.INTERFERENCE)
  ax.plot(GPUS, effs, "o-", color=color, ms=4, label=f"{label} (overlap {r['overlap']:.2f})")
  ax.plot(GPUS, cc.predict(t.seconds, allreduces, 0.0, base, GPUS), "--", color=color)
  lines.append(f"| {label} | {r['flops'] / 1e9:.0f} | {r['bytes_accessed'] / 1e9:.1f} |"
               f" {t.seconds * 1e3:.2f} ({t.bound}) | {r['overlap']:.3f} | {len(allreduces)} |"
               f" {effs[-1]:.3f} |")
w = step.RESNET50.replace(compute=cc.compute_time(
    compiled_rows["mnjax, SyncBatchNorm"]["flops"],
    compiled_rows["mnjax, SyncBatchNorm"]["bytes_accessed"], "H200").seconds)
assumed = step.scaling(w, base, ("xla",), GPUS, overlap="backward",
                       bucket_sizes=step.planned_buckets(shapes, 4 << 20),
                       interference=published.INTERFERENCE)["xla"]
ax.plot(GPUS, assumed, ":", color="k", label="assumed backprop overlap (section 7)")
gpu_axis(ax, base, w)
ax.set(ylabel="predicted weak-scaling efficiency", ylim=(0, 1.02))
ax.legend(fontsize=7, loc="lower left")
save(fig, "predicted_compiled")
display(Markdown(
    f"Compiled {aot_json['date']} ({aot_json['config']['model']}, {aot_json['config']['batch']}"
    " images per GPU):\n\n| step | GFLOP per GPU | GB moved | compute >= ms (bound) |"
    f" overlap | gradient all-reduces | efficiency at {GPUS[-1]} |\n|---|---|---|---|---|---|---|\n"
    + "\n".join(lines)))

# %% [markdown]
# The compute here is a lower bound (perfect kernels at peak): a real H200 step is longer,
# which leaves more time to hide the exchange, so these efficiencies are pessimistic. What
# the compiler settles is the overlap: XLA schedules every gradient all-reduce of mnjax's
# `xla` kind beside compute, as it does for plain `jax.jit`, and the prediction no longer
# assumes it.

# %% [markdown]
# ## 9. A cluster on one box: measured points on the link model's curves
#
# `python -m lab.bench cluster` (root; `lab.cluster`: network namespaces joined by veth
# pairs, each uplink shaped with tc to a rate) times the gradient exchange and train steps
# across emulated nodes (docs/results/cluster.md). The model is `lab.costmodel.link`:
# `alpha + (uplink bytes - the shaper's burst) / bandwidth` per exchange (in a step: alpha
# once for the buckets in flight together on `flat`, per bucket elsewhere; the burst as much
# as refilled while the link idled), alpha and bandwidth fitted once per link and layout
# (and wire) on exchanges alone, before the other points are predicted. Left: the 102 MB
# (ResNet-50) exchange per kind and wire at 1 Gbit/s on the line of its own link's fit.
# Right: the step efficiency (no-exchange step / step) of the digits CNN and a ResNet-10 on
# the curve
# `t0 / (t0 + x(nodes))` the model draws from the measured no-exchange step `t0`; the dotted
# curve is the same exchange fully overlapped, `t0 / max(t0, x)`. Points are read from the
# committed JSON; the benchmark is not run here (it needs root and ~20 min).

# %%
from lab.costmodel import link

cluster_json = json.loads((REPO / "docs" / "results" / "bench" / "cluster.json").read_text())
cluster_steps = json.loads(
    (REPO / "docs" / "results" / "bench" / "cluster_step.json").read_text())["step_points"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
MARKERS = {("flat", 1): "o", ("flat", 2): "s", ("hierarchical", 1): "^",
           ("two_dimensional", 1): "v"}
for point, color in zip([p for p in cluster_json["points"] if p["rate"] == "1gbit"],
                        ("C0", "C1")):
  fit = link.LinkFit(point["alpha_s"], point["bandwidth_Bps"])
  xs = [0, 160e6]
  a1.plot([x / 1e6 for x in xs], [(fit.alpha + x / fit.bandwidth) * 1e3 for x in xs], "--",
          color=color, label=f"model, {point['nodes']} nodes "
                             f"({fit.bandwidth * 8 / 1e9:.2f} Gbit/s fitted)")
  for r in point["rows"]:
    a1.plot(r["predicted_bytes"] / 1e6, r["exchange_s"] * 1e3,
            MARKERS[(r["kind"], r["ranks_per_node"])], color=color,
            mfc="none" if r["wire"] == "bf16" else color, ms=6)
for (kind, rpn), marker in MARKERS.items():   # legend entries for the markers
  a1.plot([], [], marker, color="gray", label=f"{kind}, {rpn} rank(s)/node (open: bf16)")
a1.set(xlabel="uplink bytes per node per exchange (MB)", ylabel="exchange time (ms)",
       title="exchanges at 1 Gbit/s (measured on the fit's line)")
a1.legend(fontsize=7)
step_rows = [dict(r, nodes=p["nodes"]) for p in cluster_steps for r in p["rows"]
             if r["predicted_exchange_s"] is not None]
VARIANT_MARKERS = {"allreduce": "o", "allreduce_bf16_wire": "D",
                   "buckets_backprop_order": "s", "double_buffering": "^", "local_sgd8": "*"}
for model, color in (("cnn", "C0"), ("resnet", "C3")):
  mine = [r for r in step_rows if r["model"] == model and r["kind"] == "flat"
          and r["ranks_per_node"] == 1]
  if not mine:
    continue
  nodes = sorted({r["nodes"] for r in mine})
  plain = {r["nodes"]: r for r in mine if r["variant"] == "allreduce"}
  a2.plot(nodes, [plain[n]["predicted_efficiency"] for n in nodes], "x--", color=color,
          label=f"{model}: model, no overlap")
  a2.plot(nodes, [plain[n]["predicted_efficiency_overlapped"] for n in nodes], "+:",
          color=color, label=f"{model}: model, fully overlapped")
  for r in mine:
    a2.plot(r["nodes"], r["efficiency"], VARIANT_MARKERS[r["variant"]], color=color, ms=6)
for variant, marker in VARIANT_MARKERS.items():
  a2.plot([], [], marker, color="gray", label=variant)
a2.set(xlabel="nodes (1 rank each)", ylabel="step efficiency", ylim=(0, 1.05),
       xticks=sorted({r["nodes"] for r in step_rows}) or [2, 4],
       title="train steps at 1 Gbit/s, flat, 1 rank per node")
a2.legend(fontsize=7)
save(fig, "cluster_link")
display(Markdown(
    "| nodes | kind | per node | model | variant | exchange ms | model | measured / model |"
    " efficiency | model |\n|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(
        f"| {r['nodes']} | {r['kind']} | {r['ranks_per_node']}x{r['devices_per_rank']} |"
        f" {r['model']} | {r['variant']} | {r['exchange_s'] * 1e3:.1f} |"
        f" {r['predicted_exchange_s'] * 1e3:.1f} |"
        f" {r['exchange_s'] / r['predicted_exchange_s']:.2f} | {r['efficiency']:.2f} |"
        f" {r['predicted_efficiency']:.2f} |" for r in step_rows)))

# %% [markdown]
# On this 2-core machine every node, rank and TCP stream shares the same two cores: only at
# 1 Gbit/s is the link the bottleneck, and with two ranks per node or at 4 nodes the cores
# set part of the time. The model is calibrated per layout for that reason, with its own
# latency for a step's first exchange after compute. In the committed run (2026-12-06,
# exchanges timed from the in-step handlers' events) the exchange rows came within 15% of
# the model in 11 of 20 (the one-latency model: 8 of 20 on the same rows): 10 of 14 on the
# link alone and under hierarchical, 1 of 6 with two ranks per node, where an exchange
# after compute does not repeat within 15% on 2 cores. Over five runs of the same command,
# 9 of the 20 rows repeat within the 1.35x that one prediction can cover at 15%, and the
# model met all 9; the other 11 (more runnable work than the 2 cores, or a sub-millisecond
# exchange) spread 1.48-3.02x between runs. Double buffering took 0.86x and
# 0.93x plain's step on the ResNet at 2 and 4 nodes, local SGD every 8 steps moved the
# ResNet's efficiency from 0.25-0.32 to 0.62-0.73.
# docs/results/cluster.md has the tables and says which claims held.

# %% [markdown]
# ## 10. When the link is slow: what overlap, the 16-bit wire and local SGD buy at scale
#
# The same H200 nodes joined by one 10 GbE (TCP) per node instead of eight NDR links
# (`hw.PRESETS["h200_10gbe"]`), ResNet-50's 12 ms step in mnjax's 4 MiB buckets, kind `flat`
# (MPI, node-aware). Overlap hides at most the step's compute, the bf16 wire halves the
# bytes, and local SGD (`mnjax.optim.local_sgd(tx, comm, every_k=k)`, DiLoCo with an
# `outer` optimizer) exchanges the parameters once every `k` steps (`step_time(...,
# sync_every=k)`). What section 9 measured on the emulated 1 Gbit/s link: double buffering
# took 0.80x plain's step where the exchange was half the compute (docs/results/cluster.md);
# local SGD's bytes are 1/k of the synchronous exchange's (tests/jobs/test_cluster.py).

# %%
slow = hw.cluster("h200_10gbe")
w = setups["h200_ndr"]
sizes16 = step.planned_buckets(shapes, 4 << 20, wire_dtype=jax.numpy.bfloat16)   # wire bytes
SLOW_OPTIONS = {   # label: (step_time options, bucket plan)
    "plain (no overlap)": ({}, sizes),
    "backprop-order buckets": ({"overlap": "backward"}, sizes),
    "double buffering": ({"overlap": "double_buffering"}, sizes),
    "bf16 wire + double buffering": ({"overlap": "double_buffering"}, sizes16),
    "local SGD, every 8": ({"sync_every": 8}, sizes),
    "local SGD, every 32, bf16 wire": ({"sync_every": 32}, sizes16),
}
fig, ax = plt.subplots(figsize=(7, 4.2))
slow_table = {}
for (label, (options, plan)), style in zip(SLOW_OPTIONS.items(),
                                           ("o-", "s--", "^:", "v-.", "D-", "x-")):
  effs = step.scaling(w, slow, ("flat",), GPUS, bucket_sizes=plan,
                      interference=published.INTERFERENCE, **options)["flat"]
  ax.plot(GPUS, effs, style, ms=4, label=label)
  slow_table[label] = effs
gpu_axis(ax, slow, w)
ax.set(ylabel="predicted weak-scaling efficiency", ylim=(0, 1.02))
ax.legend(fontsize=7, loc="lower left")
save(fig, "predicted_slow_link")
shown = [i for i, g in enumerate(GPUS) if g in (128, 1024)]
display(Markdown(
    "| flat on 10 GbE | " + " | ".join(f"{GPUS[i]} GPUs" for i in shown) + " |\n|---|"
    + "---|" * len(shown) + "\n" + "\n".join(
        f"| {label} | " + " | ".join(f"{effs[i]:.3f}" for i in shown) + " |"
        for label, effs in slow_table.items())))

# %% [markdown]
# On such a link ResNet-50's exchange takes several times the 12 ms step: overlap can hide
# at most one step's compute of it, and the bf16 wire halves it, but the step stays bound by
# the link. Only syncing less often moves the efficiency towards 1, at the price local SGD
# pays in accuracy per step (docs/results/local_sgd.md measures it on the digits job).
