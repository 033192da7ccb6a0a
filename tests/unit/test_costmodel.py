"""The cost model: published points first (validation), then the properties any alpha-beta
allreduce model must have, then calibration from the benchmark's JSON."""

import dataclasses
import doctest
import json
from pathlib import Path

import pytest

from lab import costmodel as cm
from lab.costmodel import allreduce as ar
from lab.costmodel import calibrate, published, step
from lab.costmodel import hardware as hw

REPO = Path(__file__).resolve().parents[2]
N_R50 = step.RESNET50.params * 4


@pytest.mark.parametrize("case", published.CASES,
                         ids=lambda c: c.name.split(",")[0] + ":" + c.published)
def test_published_point_is_reproduced(case):
  predicted = case.predict()
  assert case.low <= predicted <= case.high, (
      f"{case.name}: predicted {predicted:.3f}, published {case.published} "
      f"(tolerance {case.low}-{case.high}); inputs: {case.inputs}")


def test_chainermn_point_holds_over_the_assumed_compute_range():
  # The one assumed input of the ChainerMN case, over the whole 70-100 img/s range: the
  # prediction stays within two points of the published range.
  for compute in (0.32, 0.37, 0.46):
    assert 0.78 <= published.chainermn_2017(compute) <= 0.92, compute


def test_validation_rows_report_every_case():
  rows = published.validate()
  assert [r.name for r in rows] == [c.name for c in published.CASES]
  assert all(r.ok for r in rows)


@pytest.mark.parametrize("p", [2, 3, 8, 64, 1024])
def test_ring_bandwidth_term_approaches_2_p_minus_1_over_p_n_over_b(p):
  link = hw.IB_EDR
  c = hw.Cluster("one switch", 1, p, link, link)
  for nbytes in (1e8, 1e10, 1e12):
    bound = ar.ring_bandwidth_term(nbytes, p, link)
    assert bound == pytest.approx(2 * (p - 1) / p * nbytes / link.bandwidth)
    # The rest is exactly the latency term, so the ratio tends to 1 as n grows.
    assert ar.ring(nbytes, c) - bound == pytest.approx(2 * (p - 1) * link.latency, rel=1e-6)
  assert ar.ring(1e13, c) / ar.ring_bandwidth_term(1e13, p, link) == pytest.approx(1, rel=1e-5)
  # Without latency it is the bound itself, for any size.
  c0 = hw.Cluster("ideal", 1, p, dataclasses.replace(link, latency=0.0), link)
  assert ar.ring(1e6, c0) == pytest.approx(ar.ring_bandwidth_term(1e6, p, link))


def test_halving_doubling_has_the_same_bandwidth_term_and_log_latency():
  link = dataclasses.replace(hw.IB_HDR, latency=0.0)
  for p in (2, 16, 1024):
    c = hw.Cluster("one switch", 1, p, link, link)
    assert ar.halving_doubling(1e9, c) == pytest.approx(ar.ring_bandwidth_term(1e9, p, link))
  c = hw.Cluster("one switch", 1, 1024, hw.IB_HDR, hw.IB_HDR)
  assert ar.halving_doubling(8, c) < ar.ring(8, c) / 50  # 20 latencies against 2046


@pytest.mark.parametrize("nics", [1, 2, 8])
def test_halving_doubling_network_steps_share_the_nics(nics):
  # With a free node interior, halving/doubling over 16 nodes x 8 GPUs moves 2 (N-1)/N n
  # bytes per node through its NICs: the 8 GPUs' flows share them.
  free = hw.Link("free", 1e12, 1.0, 0.0)
  net = dataclasses.replace(hw.IB_EDR, latency=0.0)
  c = hw.Cluster("x", 16, 8, free, net, nics=nics)
  expected = 2 * 15 / 16 * N_R50 / (net.bandwidth * nics)
  assert ar.halving_doubling(N_R50, c) == pytest.approx(expected, rel=1e-3)


KINDS = ("flat", "hierarchical", "two_dimensional", "xla")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overlap", step.OVERLAPS)
def test_efficiency_is_monotone_in_link_bandwidth(kind, overlap):
  w = step.RESNET50.replace(compute=0.1)
  base = hw.cluster("mn_1", gpus=256)
  rates = (1, 10, 25, 50, 100, 200, 400, 800)
  inter = [step.efficiency(w, dataclasses.replace(base, inter=dataclasses.replace(
      base.inter, gbps=g)), kind, overlap=overlap) for g in rates]
  intra = [step.efficiency(w, dataclasses.replace(base, intra=dataclasses.replace(
      base.intra, gbps=g)), kind, overlap=overlap) for g in rates]
  for effs in (inter, intra):
    assert all(a <= b + 1e-12 for a, b in zip(effs, effs[1:])), effs
    assert all(0 < e <= 1 for e in effs)
  assert inter[0] < inter[-1]  # the network matters at 32 nodes


@pytest.mark.parametrize("nodes", [2, 4, 16, 128])
@pytest.mark.parametrize("network", [hw.ETH_10G, hw.ETH_25G, hw.IB_FDR])
def test_hierarchical_beats_flat_ring_when_the_network_is_the_bottleneck(nodes, network):
  c = hw.Cluster("NVLink nodes", nodes, 8, hw.NVLINK3, network)
  assert ar.hierarchical(N_R50, c) < ar.ring(N_R50, c)
  w = step.RESNET50.replace(compute=0.1)
  assert step.efficiency(w, c, "hierarchical") > step.efficiency(w, c, ar.ring)


def test_flat_ring_beats_hierarchical_when_the_node_is_the_bottleneck():
  # The converse, so the property above is about the bottleneck and not built in.
  c = hw.Cluster("PCIe nodes, fast network", 4, 8, hw.PCIE3, hw.IB_NDR)
  assert ar.ring(N_R50, c) < ar.hierarchical(N_R50, c)


def test_hierarchical_counts_its_intra_node_passes():
  c = hw.cluster("mn_1", gpus=64)
  node_ring = ar.ring(N_R50, c.with_gpus(8))
  # mnjax: psum, then a psum that hands device 0's result out; ChainerMN: reduce + bcast.
  assert ar.hierarchical(N_R50, c) - ar.hierarchical(N_R50, c, intra_allreduces=1) == (
      pytest.approx(node_ring))
  assert ar.hierarchical(N_R50, c.with_gpus(8)) == pytest.approx(2 * node_ring)
  across = ar.halving_doubling(N_R50, hw.Cluster("leaders", 8, 1, c.inter, c.inter))
  assert ar.hierarchical(N_R50, c) == pytest.approx(2 * node_ring + across)


def test_overlap_cannot_start_before_the_gradient_exists():
  w = step.RESNET50.replace(compute=1.0)
  c = hw.cluster("horovod_25gbe")
  # One bucket is ready only when the backward pass ends: nothing to hide it behind.
  one = step.step_time(w, c, "xla", overlap="backward")
  assert one.exposed == pytest.approx(one.comm)
  # Four buckets: the first three travel during the backward pass, the last one shows.
  four = step.step_time(w, c, "xla", overlap="backward", bucket_bytes=N_R50 / 4)
  last = ar.kind_time("xla", N_R50 / 4, c)
  assert four.comm == pytest.approx(4 * last)
  assert four.exposed == pytest.approx(last)  # each is done before the next one is ready


def test_two_dimensional_uses_every_nic():
  one = hw.Cluster("1 NIC", 16, 8, hw.NVLINK4, hw.IB_NDR, nics=1)
  eight = dataclasses.replace(one, nics=8)
  assert ar.two_dimensional(N_R50, eight) < ar.two_dimensional(N_R50, one) / 4
  # hierarchical crosses on one NIC: more NICs do not help it.
  assert ar.hierarchical(N_R50, eight) == pytest.approx(ar.hierarchical(N_R50, one))


def test_wire_dtype_bucketing_and_overlap_shape_the_step():
  w = step.RESNET50.replace(compute=0.1)
  c = hw.cluster("horovod_25gbe")
  fp32 = step.step_time(w, c, "xla")
  fp16 = step.step_time(w, c, "xla", wire_bytes=2)
  # Half the bytes: half the bandwidth term; the latency term stays.
  latency = step.step_time(w.replace(params=1), c, "xla").comm
  assert fp16.comm - latency == pytest.approx((fp32.comm - latency) / 2, rel=1e-3)
  assert fp32.exposed == fp32.comm and fp32.total == w.compute + fp32.comm
  back = step.step_time(w, c, "xla", overlap="backward", bucket_bytes=32 << 20)
  double = step.step_time(w, c, "xla", overlap="double_buffering")
  assert double.total == pytest.approx(max(w.compute, double.comm))
  assert double.total <= back.total < fp32.total + 1e-9
  worse = step.step_time(w, c, "xla", overlap="backward", bucket_bytes=32 << 20,
                         interference=0.5)
  assert worse.total > back.total
  # Smaller buckets: more calls, so more latency when nothing overlaps.
  many = step.step_time(w, c, "xla", bucket_bytes=1 << 16)
  assert many.comm > fp32.comm
  assert step.buckets(10, 4) == [4, 4, 2] and step.buckets(10, None) == [10]
  assert step.step_time(w, c.with_gpus(1), "xla").total == w.compute


def test_bad_inputs_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="efficiency"):
    hw.Link("x", 10, 1.5, 0)
  with pytest.raises(ValueError, match="multiple of 8"):
    hw.cluster("mn_1", gpus=12)
  with pytest.raises(ValueError, match="presets: chainermn_2017"):
    hw.cluster("nope")
  with pytest.raises(ValueError, match="kinds: flat"):
    ar.kind_time("ring_of_fire", 1e6, hw.cluster("mn_1"))
  with pytest.raises(ValueError, match="overlap must be"):
    step.step_time(step.RESNET50, hw.cluster("mn_1"), "flat", overlap="sometimes")
  with pytest.raises(ValueError, match="one node"):
    ar.kind_time("single_node", 1e6, hw.cluster("mn_1", gpus=16))


def _synthetic_bench(alpha, bandwidth, ranks, per_call, pack_bw):
  c = hw.Cluster("synthetic", 1, ranks, hw.Link("s", bandwidth * 8 / 1e9, 1.0, alpha),
                 hw.Link("s", bandwidth * 8 / 1e9, 1.0, alpha))
  sizes = [4, 64, 1024, 1 << 14, 1 << 18, 1 << 20, 1 << 24, 1 << 26, 1 << 27]
  sweep = [{"bytes": n, "seconds": {"raw_mpi": ar.ring(n, c),
                                    "mnjax_fp32": ar.ring(n, c) + per_call}} for n in sizes]
  fused = ar.ring(N_R50, c)
  return {"mpi": {"ranks": ranks, "sweep": sweep, "resnet50": {
      "raw_mpi_fused": fused, "mnjax_bucket_4MB": fused + 2 * N_R50 / pack_bw}}}


@pytest.mark.parametrize("ranks", [2, 4])
def test_calibration_recovers_known_alpha_beta_and_overheads(ranks):
  data = _synthetic_bench(alpha=3e-6, bandwidth=5e9, ranks=ranks, per_call=20e-6, pack_bw=2e9)
  cal = calibrate.from_allreduce_json(data)
  assert cal.raw_link.latency == pytest.approx(3e-6, rel=0.05)  # + ~1 kB of transfer
  assert cal.raw_link.bandwidth == pytest.approx(5e9, rel=0.01)
  assert cal.software.per_call == pytest.approx(20e-6, rel=0.01)
  assert cal.software.pack_bandwidth == pytest.approx(2e9, rel=0.01)
  with pytest.raises(ValueError, match="mpi.sweep"):
    calibrate.from_allreduce_json({"psum": {}})


def test_calibration_from_the_committed_benchmark_predicts_its_own_sweep():
  path = REPO / "docs/results/bench/allreduce.json"
  data = json.loads(path.read_text())
  cal = calibrate.from_allreduce_json(path)
  c = cal.cluster()
  for row in data["mpi"]["sweep"]:
    ratio = ar.ring(row["bytes"], c) / row["seconds"]["raw_mpi"]
    if row["bytes"] >= 32 << 20:  # gradient sizes, beyond the caches: within 25%
      assert 0.8 < ratio < 1.25, (row["bytes"], ratio)
    elif row["bytes"] <= 64:  # latency-bound: within a factor 2
      assert 0.5 < ratio < 2, (row["bytes"], ratio)


def test_docstring_examples_run():
  for module in (cm, cm.hardware, cm.allreduce, cm.step, cm.published, cm.calibrate):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, module.__name__


def test_calibrated_model_predicts_the_measured_two_rank_step():
  # Calibrated on the allreduce benchmark alone, the model predicts the digits step's
  # communication efficiency measured by another benchmark (bound ranks, one per core).
  cal = calibrate.from_allreduce_json(REPO / "docs/results/bench/allreduce.json")
  scaling = json.loads((REPO / "docs/results/bench/scaling.json").read_text())
  two = next(r for r in scaling["rows"] if r["ranks"] == 2)
  w = step.Workload("digits CNN", scaling["params"], compute=two["seconds_no_communication"])
  predicted = step.efficiency(w, cal.cluster(2), "flat", software=cal.software)
  assert abs(predicted - two["communication_efficiency"]) < 0.07, (predicted, two)


# --- NCCL (kind "xla"): ring, double binary tree, and the tuner's choice between them ------
H200 = hw.PRESETS["h200_ndr"]


@pytest.mark.parametrize("nbytes", [25 << 20, N_R50])  # DDP's bucket and the whole gradient
def test_nccl_tree_beats_the_ring_at_1024_h200s_and_auto_takes_it(nbytes):
  c = H200.with_gpus(1024)
  tree, ring = ar.double_binary_tree(nbytes, c), ar.nccl_allreduce(nbytes, c, "ring")
  assert tree < ring / 5  # 2046 ring steps of 3 us against 14 + 14 hops
  assert ar.kind_time("xla", nbytes, c) == pytest.approx(tree)
  assert ar.kind_time("xla", nbytes, c, nccl="tree") == pytest.approx(tree)
  # A mutant that always takes the ring fails here: its step is the latency-bound one.
  w = step.RESNET50.replace(compute=0.012)
  assert step.efficiency(w, c, "xla") > 0.9 > 0.7 > step.efficiency(w, c, "xla", nccl="ring")


@pytest.mark.parametrize("gpus", [16, 64, 256, 1024])
def test_nccl_tree_wins_small_messages_at_any_multi_node_scale(gpus):
  c = H200.with_gpus(gpus)
  assert ar.double_binary_tree(4, c) < ar.nccl_allreduce(4, c, "ring")
  assert ar.kind_time("xla", 4, c) == pytest.approx(ar.double_binary_tree(4, c))


def test_nccl_ring_wins_on_one_node_for_large_messages():
  c = H200.with_gpus(8)
  ring, tree = ar.nccl_allreduce(N_R50, c, "ring"), ar.double_binary_tree(N_R50, c)
  # Same 2 (g-1) latencies; the ring sends 2 (g-1)/g n per GPU, the chain 2 n.
  assert ring < tree
  assert tree - ring == pytest.approx(2 * N_R50 / 8 / H200.intra.bandwidth, rel=1e-9)
  assert ar.kind_time("xla", N_R50, c) == pytest.approx(ring)  # a tree-only mutant fails
  assert ar.double_binary_tree(4, c) == pytest.approx(ar.ring(4, c), rel=1e-3)  # a tie


@pytest.mark.parametrize("preset", ["mn_1", "h200_ndr", "horovod_25gbe", "big_basin_50gbe"])
def test_nccl_auto_is_the_min_of_ring_and_tree(preset):
  base = hw.PRESETS[preset]
  for gpus in (base.gpus_per_node, 4 * base.gpus_per_node, base.gpus):
    c = base.with_gpus(gpus)
    for nbytes in (4, 1 << 16, 1 << 22, N_R50):
      ring, tree = ar.nccl_allreduce(nbytes, c, "ring"), ar.nccl_allreduce(nbytes, c, "tree")
      assert ar.kind_time("xla", nbytes, c) == pytest.approx(min(ring, tree))
      assert ar.kind_time("xla", nbytes, c, nccl="ring") == pytest.approx(ring)
  with pytest.raises(ValueError, match="choose from auto, ring, tree"):
    ar.kind_time("xla", 4, base, nccl="collnet")


def test_nccl_tree_latency_grows_as_log2_of_the_nodes_not_linearly():
  small, big = H200.with_gpus(64), H200.with_gpus(1024)  # 8 and 128 nodes
  tree = ar.double_binary_tree(4, big) - ar.double_binary_tree(4, small)
  assert tree == pytest.approx(2 * (7 - 3) * H200.inter.latency, rel=1e-6)
  ring = ar.nccl_allreduce(4, big, "ring") - ar.nccl_allreduce(4, small, "ring")
  assert ring == pytest.approx(2 * (1024 - 64) * H200.intra.latency, rel=1e-3)
  # Node counts between powers of two take the next level: ceil(log2 3) = 2 = log2 4.
  assert ar.double_binary_tree(4, H200.with_gpus(24)) == pytest.approx(
      ar.double_binary_tree(4, H200.with_gpus(32)))


@pytest.mark.parametrize("nics", [1, 2, 8])
def test_nccl_tree_bandwidth_term_is_2n_over_the_node_network(nics):
  free = hw.Link("free", 1e12, 1.0, 0.0)
  net = dataclasses.replace(hw.IB_NDR, latency=0.0)
  c = hw.Cluster("x", 16, 8, free, net, nics=nics)
  assert ar.double_binary_tree(N_R50, c) == pytest.approx(2 * N_R50 / (nics * net.bandwidth))
  # The ring's is 2 (p-1)/p n over the same NICs: a tie as p grows.
  ratio = ar.nccl_allreduce(N_R50, c, "ring") / ar.double_binary_tree(N_R50, c)
  assert ratio == pytest.approx(127 / 128, rel=1e-3)
  # A slower node interior is the bottleneck instead (pipelined, not added).
  slow = dataclasses.replace(c, intra=dataclasses.replace(free, gbps=8 * nics))
  assert ar.double_binary_tree(N_R50, slow) == pytest.approx(2 * N_R50 / slow.intra.bandwidth)


@pytest.mark.parametrize("gpus", [8, 1024])
@pytest.mark.parametrize("kind", ["flat", "xla"])
def test_best_bucket_bytes_is_the_argmin_of_the_overlapped_step(gpus, kind):
  w = step.RESNET50.replace(compute=0.012)
  c = H200.with_gpus(gpus)
  best = step.best_bucket_bytes(w, c, kind)
  assert best in step.BUCKET_CANDIDATES
  times = {b: step.step_time(w, c, kind, bucket_bytes=b, overlap="backward").total
           for b in step.BUCKET_CANDIDATES}
  assert times[best] == min(times.values())
  assert best == min(step.BUCKET_CANDIDATES, key=times.get)
  assert times[best] < times[None]  # overlap pays for several buckets here
  # Horovod's 5 ms per call makes one buffer best; a subset of candidates is honoured.
  slow = step.Software(per_call=5e-3)
  assert step.best_bucket_bytes(w, c, kind, software=slow) is None
  assert step.best_bucket_bytes(w, c, kind, candidates=(64 << 20,)) == 64 << 20
  with pytest.raises(ValueError, match="candidates"):
    step.best_bucket_bytes(w, c, kind, candidates=(0,))


@pytest.mark.parametrize("gpus", [8, 1024])
@pytest.mark.parametrize("kind", ["flat", "xla"])
def test_the_gpu_default_bucket_is_the_models_choice(kind, gpus):
  """mnjax's GPU default (`mnjax.comm.DEFAULT_BUCKET_BYTES["gpu"]`) is what the model picks
  for ResNet-50 on H200s, with an assumed 30 us per call (mpi4jax's CUDA handler
  synchronises the stream and stages through the host; unmeasured: no GPU here)."""
  from mnjax.comm import DEFAULT_BUCKET_BYTES

  w = step.RESNET50.replace(compute=0.012)
  best = step.best_bucket_bytes(w, hw.cluster("h200_ndr", gpus=gpus), kind,
                                   software=step.Software(per_call=30e-6))
  assert best == DEFAULT_BUCKET_BYTES["gpu"]


# --- ZeRO-1 (shard_optimizer): the allreduce's wire bytes, 1/P of the update and its state --
def test_local_sgd_pays_the_exchange_once_per_round():
  w = step.RESNET50.replace(compute=0.012)
  c = hw.cluster("h200_10gbe", gpus=256)
  plain = step.step_time(w, c, "flat")
  for k in (2, 8, 64):
    local = step.step_time(w, c, "flat", sync_every=k)
    assert local.comm == pytest.approx(plain.comm / k) and local.exposed == local.comm
  assert step.efficiency(w, c, "flat", sync_every=8) > step.efficiency(w, c, "flat")
  for bad in (0, 1.5, "8"):
    with pytest.raises(ValueError, match="sync_every must be an int"):
      step.step_time(w, c, "flat", sync_every=bad)
  with pytest.raises(ValueError, match="overlap='none' only"):
    step.step_time(w, c, "flat", sync_every=8, overlap="backward")


def test_zero1_step_divides_the_update_and_the_state_not_the_wire():
  w = step.RESNET50.replace(compute=0.1, update=0.02)
  c = hw.cluster("h200_ndr", gpus=8)
  plain = step.step_time(w, c, "flat")
  zero = step.step_time(w, c, "flat", shard_optimizer=True)
  # By hand: 0.1 - 0.02 + 0.02 / 8 = 0.0825 s of compute; reduce-scatter + all-gather are
  # the allreduce's bytes, so comm is the allreduce's, to the bit.
  assert zero.compute == pytest.approx(0.0825, rel=1e-12)
  assert zero.comm == plain.comm and zero.total == pytest.approx(0.0825 + plain.comm)
  assert plain.compute == 0.1
  assert step.step_time(w, c.with_gpus(1), "flat", shard_optimizer=True).total == 0.1
  # Adam on ResNet-50: 25,557,032 x 8 B = 204,456,256 B replicated; 51,114,064 B on 4 GPUs.
  assert step.optimizer_state_bytes(step.RESNET50, 4) == 204_456_256
  assert step.optimizer_state_bytes(step.RESNET50, 4, shard_optimizer=True) == 51_114_064
  # Nothing to divide without an update time: the step is the allreduce step.
  no_update = w.replace(update=0.0)
  assert (step.step_time(no_update, c, "flat", shard_optimizer=True)
          == step.step_time(no_update, c, "flat"))
  # A step that is all update (the benchmark's ResNet-50-sized update step) runs in 1/P.
  only = w.replace(compute=0.0077, update=0.0077)
  assert step.step_time(only, c.with_gpus(3), "flat", shard_optimizer=True).compute == (
      pytest.approx(0.0077 / 3, rel=1e-12))
  with pytest.raises(ValueError, match="overlap='none' only"):
    step.step_time(w, c, "flat", shard_optimizer=True, overlap="backward")
  with pytest.raises(ValueError, match="0 <= update <= compute"):
    w.replace(update=0.2)
