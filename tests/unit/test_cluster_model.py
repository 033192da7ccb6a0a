"""lab.cluster without namespaces (argument checks, the mpirun line, the job's environment), the
cluster benchmark's argument checks, and lab.costmodel.link (uplink bytes, the alpha/beta
fit, the shaper's burst refilling while the link idles, a step's first exchange's own alpha).
"""

import pytest

from lab import cluster
from lab.costmodel import link


@pytest.mark.parametrize("rate,bits", [("1gbit", 1e9), ("10GBIT", 1e10), ("500mbit", 5e8),
                                       ("none", None)])
def test_rates(rate, bits):
  assert cluster.rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["1gbyte", "fast", "0gbit", "-1gbit", ""])
def test_bad_rates_say_what_is_expected(rate):
  with pytest.raises(cluster.ClusterError, match="expected a positive tc rate"):
    cluster.rate_bits(rate)


@pytest.mark.parametrize("args,message", [
    (["--parts", "steps"], "--parts: exchange, step and/or gap, got 'steps'"),
    (["--parts", "step", "--fit-before", "none,nap"],
     "--fit-before: one or more of none, sleep, compute_aligned, compute, got 'none,nap'"),
])
def test_the_cluster_benchmark_refuses_bad_parts_and_gaps_before_any_job(args, message):
  from lab.bench import cluster as bench
  with pytest.raises(SystemExit, match=message):
    bench.main(args)


def test_without_root_it_says_so(monkeypatch):
  monkeypatch.setattr("os.geteuid", lambda: 1000)
  with pytest.raises(cluster.ClusterError, match="needs root"):
    cluster.check_available()
  with pytest.raises(cluster.ClusterError, match="needs root"):
    cluster.up(2, "1gbit")


def test_too_many_nodes_before_anything_is_built():
  with pytest.raises(cluster.ClusterError, match="between 1 and 253"):
    cluster.up(254, "1gbit")


def test_the_mpirun_line_enters_each_node_through_the_wrapper(tmp_path):
  c = cluster.Cluster("x", 3, "1gbit")
  line = cluster.command(c, ["python", "job.py"], 2, tmp_path / "w.sh")
  assert line[:4] == ["ip", "netns", "exec", "mnjaxc-x-hub"]
  i = line.index("-hosts")
  assert line[i + 1] == "10.231.0.1,10.231.0.2,10.231.0.3"
  assert line[line.index("-n") + 1] == "6" and line[line.index("-ppn") + 1] == "2"
  assert line[line.index("-launcher-exec") + 1] == str(tmp_path / "w.sh")
  assert line[-2:] == ["python", "job.py"]


def test_the_job_uses_tcp_between_nodes_and_keeps_the_users_settings(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  monkeypatch.delenv("UCX_TLS", raising=False)
  env = cluster.job_env(2)
  assert env["UCX_TLS"] == "tcp,self" and env["UCX_NET_DEVICES"] == "eth0"
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
  monkeypatch.setenv("UCX_TLS", "tcp")
  assert cluster.job_env(None)["UCX_TLS"] == "tcp"


def test_uplink_bytes():
  n = 4e6
  for kind in ("flat", "hierarchical", "two_dimensional"):
    assert link.uplink_bytes(kind, n, nodes=4, ranks_per_node=2) == pytest.approx(1.5 * n)
  assert link.uplink_bytes("hierarchical", n, nodes=4, wire_bits=16) == pytest.approx(0.75 * n)
  assert link.uplink_bytes("flat", n, nodes=1) == 0
  for k in (1, 2, 4, 8):  # the node-aware 16-bit wire: half of float32's, at any k
    assert link.uplink_bytes("flat", n, nodes=2, ranks_per_node=k, wire_bits=16) == (
        pytest.approx(0.5 * link.uplink_bytes("flat", n, nodes=2, ranks_per_node=k)))
  with pytest.raises(ValueError, match="knows flat"):
    link.uplink_bytes("ring", n, nodes=2)
  # gloo's ring over every device: 2 nodes x 2 devices send 1.5 n per node, not n
  assert link.uplink_bytes("xla", n, nodes=2, ranks_per_node=2) == pytest.approx(1.5 * n)
  assert link.uplink_bytes("xla", n, nodes=2) == link.uplink_bytes("flat", n, nodes=2)
  # ZeRO-1: an allreduce's bytes with one rank per node; 1.75 n at 2 x 2 (not node-aware)
  assert link.uplink_bytes("shard_optimizer", n, nodes=4) == pytest.approx(1.5 * n)
  assert link.uplink_bytes("shard_optimizer", n, nodes=2, ranks_per_node=2) == pytest.approx(
      1.75 * n)
  with pytest.raises(ValueError, match="float32 wire"):
    link.uplink_bytes("shard_optimizer", n, nodes=2, wire_bits=16)


def test_fit_recovers_alpha_and_bandwidth():
  f = link.LinkFit(2e-3, 1.1e8)
  sizes = [1e6, 4e6, 1.6e7, 6.4e7]
  times = [f.exchange_time("flat", s, nodes=2) for s in sizes]
  g = link.fit([link.uplink_bytes("flat", s, nodes=2) for s in sizes], times)
  assert g.alpha == pytest.approx(2e-3) and g.bandwidth == pytest.approx(1.1e8)
  with pytest.raises(ValueError, match="not the bottleneck"):
    link.fit([1e6, 2e6], [0.2, 0.1])


def test_the_shapers_burst_refills_while_the_link_idles_and_the_fit_knows_it():
  """Exchanges back to back get only the burst that refilled between them: a fit that
  assumes the whole burst each time is wrong; one told the idle times is right."""
  shaped = link.LinkFit(1e-3, 1.1e8, burst=2.5e5, refill=1.25e8)   # 1 Gbit/s
  assert shaped.available_burst(None) == shaped.available_burst(1.0) == 2.5e5
  assert shaped.available_burst(1e-3) == pytest.approx(1.25e5)
  assert shaped.available_burst(-1.0) == 0.0
  after_compute = shaped.exchange_time("flat", 6e5, nodes=2, idle_s=0.01)
  back_to_back = shaped.exchange_time("flat", 6e5, nodes=2, idle_s=1e-4)
  assert back_to_back - after_compute == pytest.approx((2.5e5 - 1.25e4) / 1.1e8)
  sizes = [6.4e4, 2.5e5, 1e6, 4e6]
  idle = [2e-4] * len(sizes)   # an exchange-only step: the link idles 0.2 ms between two
  times = [shaped.exchange_time("flat", s, nodes=2, idle_s=i) for s, i in zip(sizes, idle)]
  sent = [link.uplink_bytes("flat", s, nodes=2) for s in sizes]
  told = link.fit(sent, times, burst=2.5e5, refill=1.25e8, idle_s=idle, relative=True)
  assert told.alpha == pytest.approx(1e-3) and told.bandwidth == pytest.approx(1.1e8)
  assert told.refill == 1.25e8
  blind = link.fit(sent, times, burst=2.5e5, relative=True)   # the whole burst every time
  assert abs(blind.alpha - 1e-3) > 5e-4


def test_a_steps_buckets_pay_alpha_once_in_flight_and_each_one_after_the_other():
  f = link.LinkFit(2e-3, 1e8)
  buckets = [1e6, 2e6, 4e6]
  one = f.exchange_time("flat", sum(buckets), nodes=4)
  together = f.buckets_time("flat", buckets, nodes=4, in_flight=True)
  apart = f.buckets_time("flat", buckets, nodes=4)
  assert together == pytest.approx(one)   # the bytes of one exchange, one latency
  assert apart == pytest.approx(one + 2 * f.alpha)
  # The wire and the layout count as in exchange_time, bucket by bucket.
  assert f.buckets_time("flat", buckets, nodes=4, ranks_per_node=2, wire_bits=16) == (
      pytest.approx(sum(f.exchange_time("flat", b, nodes=4, ranks_per_node=2, wire_bits=16)
                        for b in buckets)))
  assert f.buckets_time("flat", [], nodes=4) == 0.0


def test_a_steps_first_exchange_pays_alpha_first_and_the_fit_tells_the_two_apart():
  """After the step's compute the first bucket pays `alpha_first`; the buckets after it
  (one after the other) pay `alpha`. Points back to back and after idle, marked, give both;
  one alpha for all of them fits neither."""
  f = link.LinkFit(2e-4, 1.1e8, burst=2.5e5, refill=1.25e8, alpha_first=6e-4)
  buckets = [1e5, 5e5, 2e5]
  apart = f.buckets_time("flat", buckets, nodes=2, idle_s=0.01)
  together = f.buckets_time("flat", buckets, nodes=2, idle_s=0.01, in_flight=True)
  beyond = (sum(buckets) - 2.5e5) / 1.1e8
  assert apart == pytest.approx(6e-4 + 2 * 2e-4 + beyond)
  assert together == pytest.approx(6e-4 + beyond)
  assert link.LinkFit(2e-4, 1.1e8).buckets_time("flat", buckets, nodes=2) == pytest.approx(
      3 * 2e-4 + sum(buckets) / 1.1e8)   # no alpha_first: alpha for every bucket
  sizes = [6.4e4, 2.5e5, 1e6, 4e6]
  idle = [2e-4] * 4 + [0.01] * 4   # back to back, then each after 10 ms of idle
  first = [False] * 4 + [True] * 4
  times = [f.buckets_time("flat", [s], nodes=2, idle_s=i) - (0 if m else 4e-4)
           for s, i, m in zip(sizes * 2, idle, first)]
  sent = [link.uplink_bytes("flat", s, nodes=2) for s in sizes * 2]
  both = link.fit(sent, times, burst=2.5e5, refill=1.25e8, idle_s=idle, first=first,
                  relative=True)
  assert both.alpha == pytest.approx(2e-4) and both.alpha_first == pytest.approx(6e-4)
  assert both.bandwidth == pytest.approx(1.1e8)
  one = link.fit(sent, times, burst=2.5e5, refill=1.25e8, idle_s=idle, relative=True)
  assert one.alpha_first is None and abs(one.alpha - 2e-4) > 1e-4
  with pytest.raises(ValueError, match="some True and some False"):
    link.fit(sent, times, first=[True] * 8)


def test_the_step_benchmark_predicts_each_variant_from_its_layouts_fit():
  from lab.bench.cluster_step import EXCHANGE_ROWS, predicted_exchange, within
  fp32, bf16 = link.LinkFit(1e-3, 1e8), link.LinkFit(3e-3, 5e7)
  plan = [5e5, 1e6]
  got = {v: predicted_exchange({"fp32": fp32, "bf16": bf16}, "flat", v, plan, nodes=2,
                               ranks_per_node=2)
         for v in ("allreduce", "allreduce_bf16_wire", "local_sgd8")}
  assert got["allreduce"] == pytest.approx(fp32.buckets_time(
      "flat", plan, nodes=2, ranks_per_node=2, in_flight=True))
  # bf16: the plan is in wire bytes (float32 bytes / 2), its own fit, one bucket at a time
  assert got["allreduce_bf16_wire"] == pytest.approx(bf16.buckets_time(
      "flat", [2 * b for b in plan], nodes=2, ranks_per_node=2, wire_bits=16))
  assert got["local_sgd8"] == pytest.approx(got["allreduce"] / 8)
  # Other kinds chain each bucket through the previous one's sum: alpha per bucket.
  assert predicted_exchange({"fp32": fp32}, "hierarchical", "allreduce", plan, nodes=2,
                            ranks_per_node=1) == pytest.approx(
      fp32.buckets_time("hierarchical", plan, nodes=2))
  assert predicted_exchange({"fp32": None}, "flat", "allreduce", plan, nodes=2,
                            ranks_per_node=1) is None
  # The link idles while the step computes (local SGD: every_k steps) and its burst refills.
  shaped = {"fp32": link.LinkFit(1e-3, 1e8, burst=2.5e5, refill=1.25e8)}
  short = {v: predicted_exchange(shaped, "flat", v, plan, nodes=2, ranks_per_node=1,
                                 compute_s=1e-3) for v in ("allreduce", "local_sgd8")}
  assert short["allreduce"] == pytest.approx(shaped["fp32"].buckets_time(
      "flat", plan, nodes=2, in_flight=True, idle_s=1e-3))
  assert short["local_sgd8"] == pytest.approx(shaped["fp32"].buckets_time(
      "flat", plan, nodes=2, in_flight=True, idle_s=8e-3) / 8)
  assert short["allreduce"] > 8 * short["local_sgd8"]
  rows = [{"variant": v, "exchange_s": x * s, "predicted_exchange_s": x}
          for v, x, s in zip(EXCHANGE_ROWS, (1.0, 2.0, 3.0), (1.2, 0.9, 1.1))]
  assert within(rows) == (2, 3)
