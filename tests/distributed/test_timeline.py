"""The timeline: a valid Perfetto trace with every collective once per rank and its bytes,
the injected straggler named with its lateness, the handlers' time of an exchange free of the
wait for it, and the fit worker's exchanges timed after their gap, clocks aligned within
1 ms, nothing traced into a step while it is off, a size limit that keeps the last steps, bad
paths refused on every rank."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from lab.models import SmallCNN
from lab.runner import RunConfig, create_train_state, guarded_optimizer, make_train_step, train_loop
from mnjax.comm._instep import _allreduce as collectives
from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep import _recorder as recorder
from mnjax.guard import _timeline as timeline_module

TREE = {"a": jnp.ones(300), "b": jnp.ones(100), "c": jnp.ones(2000)}
BUCKET_BYTES = 2048  # "c" travels alone, "a" and "b" in buckets of their own


def shared_path(comm, tmp_path, name):
  return comm.mpi_comm.bcast(str(tmp_path / name), root=0)


def read_trace(comm, path):
  """Rank 0's trace, on every rank (so that every rank asserts the same)."""
  return comm.mpi_comm.bcast(json.load(open(path)) if comm.rank == 0 else None, root=0)


def step_fn(kc, wire_dtype=None, slow_rank=None, sleep=0.0):
  """A marked step: (counter, tree) -> (counter + 1, the tree's mean over replicas)."""
  def per_device(n, tree):
    n = recorder.mark_step(n)
    if slow_rank is not None:  # one rank arrives late at the first collective
      def nap(x):
        if kc.rank == slow_rank:
          time.sleep(sleep)
        return x
      tree = dict(tree, c=jax.pure_callback(nap, tree["c"], tree["c"]))
    out = collectives.allreduce_tree(tree, kc, wire_dtype=wire_dtype, bucket_bytes=BUCKET_BYTES)
    n = recorder.mark_step(n + 1, end=True, after=recorder.completion(out))
    return n, out
  return mnjax.data_parallel(per_device, kc, batch_argnums=())  # with the pre-flight check


def expected_bytes():
  """The float32 bytes of each bucket `allreduce_tree` plans for TREE."""
  order, buckets = bucketing.tree_buckets(TREE, wire_dtype=None, bucket_bytes=BUCKET_BYTES)
  leaves = [jax.tree.leaves(TREE)[i] for i in order]
  return sorted(sum(leaves[p].size for p in b.positions) * 4 for b in buckets)


def collectives_of(trace, step, rank, host=False):
  return [e for e in trace["traceEvents"] if e.get("cat") == "collective"
          and e["pid"] == rank and e["args"]["step"] == step and e["args"]["host"] == host]


@pytest.mark.parametrize("kind", ["flat", "two_dimensional"])
def test_every_collective_of_a_step_appears_once_per_rank_with_its_bytes(comm, tmp_path, kind):
  kc = comm if kind == "flat" else mnjax.create_communicator(kind)
  path = shared_path(comm, tmp_path, "trace.json")
  wires = (None, jnp.bfloat16) if kind == "flat" else (None,)
  with mnjax.guard.Timeline(kc, path, verbose=False) as timeline:
    n = jnp.int32(0)
    for wire_dtype in wires:  # bfloat16: 'bytes' is still the float32 buffer reduced
      step = step_fn(kc, wire_dtype)
      for _ in range(2):
        timeline.step(int(n))
        n, _ = step(n, TREE)
        jax.block_until_ready(n)
  trace = read_trace(comm, path)
  events = trace["traceEvents"]
  for e in events:  # the fields Perfetto reads
    assert {"name", "ph", "pid", "tid"} <= set(e)
    if e["ph"] == "X":
      assert isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] in range(comm.size)
  assert sorted({e["pid"] for e in events}) == list(range(comm.size))
  steps = {(e["pid"], e["args"]["step"]) for e in events if e.get("cat") == "step"}
  assert steps == {(r, s) for r in range(comm.size) for s in range(2 * len(wires))}
  want = expected_bytes() if kc.num_replicas > 1 else []
  for rank in range(comm.size):
    for s in range(2 * len(wires)):
      got = collectives_of(trace, s, rank)
      assert sorted(e["args"]["bytes"] for e in got) == (want if comm.size > 1 else [])
      assert sorted(e["args"]["bucket"] for e in got) == list(range(len(got)))
      assert all(e["args"]["op"] == "bucket allreduce" for e in got)
      if s >= 2:  # the 16-bit wire moved half the bytes (one alltoall + one allgather)
        assert all(e["args"]["wire_bytes"] < e["args"]["bytes"] for e in got)
    checks = {e["name"] for s in range(2 * len(wires))
              for e in collectives_of(trace, s, rank, host=True)}
    assert checks == ({"pre-flight check"} if comm.size > 1 else set())  # the step's, traced


def test_the_injected_straggler_is_named_with_its_lateness(comm, tmp_path):
  if comm.size == 1:
    pytest.skip("a straggler needs two ranks")
  sleep, slow = 0.3, comm.size - 1
  path = shared_path(comm, tmp_path, "slow.json")
  # Shifted clocks (100 ms per rank): only the alignment can make the lateness come out right.
  with mnjax.guard.Timeline(comm, path, verbose=False,
                            _clock_shift_ns=100_000_000 * comm.rank) as timeline:
    step, n = step_fn(comm, slow_rank=slow, sleep=sleep), jnp.int32(0)
    for _ in range(3):
      timeline.step(int(n))
      n, _ = jax.block_until_ready(step(n, TREE))
    report = timeline.report()
  assert report["straggler"] == slow
  late = report["ranks"][slow]
  assert late["last"] == 3 and late["last_share"] == 1.0  # every step
  assert late["late_median_ms"] == pytest.approx(sleep * 1e3, rel=0.2)
  assert report["ranks"][0]["wait_share"] > report["ranks"][slow]["wait_share"]
  assert f"rank {slow} arrived last" in timeline_module._straggler.summary(report)
  trace = read_trace(comm, path)
  waits = [e["args"]["wait_us"] for e in collectives_of(trace, 1, 0)]
  assert max(waits) == pytest.approx(sleep * 1e6, rel=0.2)


def test_the_handlers_time_an_exchange_without_the_wait_for_a_straggler(comm):
  """`lab.bench.handler_time`: each collective from its last arrival to its last completion,
  not the 0.2 s the other ranks wait for the late one (what a step-time difference holds)."""
  from lab.bench.handler_time import exchange_seconds
  sleep = 0.2
  slow = step_fn(comm, slow_rank=comm.size - 1, sleep=sleep)
  state = jax.block_until_ready(slow(jnp.int32(0), TREE))
  start = time.perf_counter()
  seconds, idle, (n, _) = exchange_seconds(state, lambda s: slow(*s), comm.mpi_comm,
                                           windows=2, steps=2)
  per_step = (time.perf_counter() - start) / 4
  assert int(n) == 5   # 1 + 2 windows x 2 steps
  assert per_step >= sleep
  if comm.size == 1:   # no exchange crosses processes
    assert seconds == 0.0 and idle is None
  else:
    assert 0.0 < seconds < sleep / 4, seconds
    # Between two steps' exchanges: the late rank's nap, less the early rank's last
    # completion after the late one's (the idle runs from the last completion).
    assert 0.9 * sleep <= idle < 2 * sleep, idle


def test_the_fit_worker_times_each_exchange_after_its_gap(comm):
  """``cluster_worker --before``: the handlers' idle time before each exchange holds the
  0.1 s sleep each step follows, beyond the back-to-back steps'; with compute before each
  step (calibrated to the machine's speed as the gap is built) the steps run too; the
  parameters stay identical across ranks; an unknown gap is refused."""
  from lab.bench.cluster_worker import _measure, gap
  with pytest.raises(ValueError, match="compute_aligned"):
    gap("nap", 0.1, comm.mpi_comm)
  rows = {mode: _measure(comm, 1000, "fp32", 3, windows=2, first=gap(mode, 0.1, comm.mpi_comm))
          for mode in ("none", "sleep", "compute_aligned")}
  assert all(r["ranks_agree"] and r["handler_seconds_per_step"] is not None
             for r in rows.values())
  idle = {mode: r["handler_idle_seconds"] for mode, r in rows.items()}
  if comm.size == 1:   # nothing crosses processes: no exchange, no idle between
    assert all(i is None for i in idle.values())
    return
  # The sleep is exact, less the last completion's lag (as above); back to back, the steps
  # follow one another as fast as the machine lets them, and the sleep adds its 0.1 s.
  assert idle["sleep"] >= 0.09 and idle["sleep"] - idle["none"] >= 0.05, idle
  assert idle["compute_aligned"] > 0, idle


def test_clock_offsets_are_estimated_within_a_millisecond(comm, tmp_path):
  shift = 3_700_000 * comm.rank  # ns: rank r's clock runs 3.7 ms x r ahead
  timeline = mnjax.guard.Timeline(comm, shared_path(comm, tmp_path, "clock.json"),
                                  verbose=False, _clock_shift_ns=shift)
  try:
    truth = -3_700_000 * np.arange(comm.size)
    assert np.abs(timeline.offsets - truth).max() < 1_000_000
    assert timeline.errors.max() < 1_000_000
  finally:
    timeline.close()


def test_nothing_is_traced_into_a_step_while_the_timeline_is_off(comm, tmp_path):
  def lowered():
    return jax.jit(lambda n, t: step_fn(comm)(n, t)).lower(jnp.int32(0), TREE).as_text()
  before = lowered()
  with mnjax.guard.Timeline(comm, shared_path(comm, tmp_path, "off.json"), verbose=False):
    on = lowered()
  assert "mnjax_mark" in on and "mnjax_mark" not in before
  assert lowered() == before


def test_over_the_size_limit_the_last_steps_are_kept_and_the_trace_says_so(comm, tmp_path):
  path = shared_path(comm, tmp_path, "ring.json")
  with mnjax.guard.Timeline(comm, path, verbose=False, max_events=4) as timeline:
    for s in range(6):
      timeline.step(s)
      start = recorder.now_ns()  # the one recording hook of host-side operations
      recorder.record("host op", start, start + 1000, bytes=8)
  trace = read_trace(comm, path)
  kept = {e["args"]["step"] for e in trace["traceEvents"] if e.get("name") == "host op"}
  assert kept and min(kept) > 0 and max(kept) == 5
  assert "kept the last steps" in trace["otherData"]["dropped"]


@pytest.mark.parametrize("where", ["missing_parent_file", "directory"])
def test_a_trace_path_that_cannot_be_written_is_an_error_on_every_rank(comm, tmp_path,
                                                                       monkeypatch, where):
  base = shared_path(comm, tmp_path, "")
  if comm.rank == 0:
    (tmp_path / "file").write_text("")
  comm.mpi_comm.Barrier()
  path = f"{base}/file/trace.json" if where == "missing_parent_file" else base
  monkeypatch.setenv(timeline_module.ENV, path)
  with pytest.raises(ValueError, match="cannot write the trace"):
    timeline_module.from_env(comm)
  assert not recorder.active()


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_the_train_loop_honours_mnjax_timeline_and_refuses_a_bad_one_before_any_step(
    comm, tmp_path, monkeypatch):
  digits = mnjax.data.load_digits("train")
  workdir = shared_path(comm, tmp_path, "w")  # rank 0's folder: rank 0 writes
  config = RunConfig(epochs=1, global_batch_size=8 * comm.size, workdir=workdir,
                     progress=False, stall_timeout=0.0, tensorboard="", checkpoint_every=0)
  state = create_train_state(SmallCNN(), guarded_optimizer(optax.sgd(0.1), comm, config),
                             digits.images[:1], jax.random.key(0))
  calls = []
  step = make_train_step(comm)

  def counted(*args):
    calls.append(1)
    return step(*args)

  def batches(epoch, start):
    for i in range(start, 2):
      idx = slice(8 * (comm.size * i + comm.rank), 8 * (comm.size * i + comm.rank + 1))
      yield digits.images[idx], digits.labels[idx]

  if comm.rank == 0:
    (tmp_path / "file").write_text("")
  comm.mpi_comm.Barrier()
  monkeypatch.setenv(timeline_module.ENV, shared_path(comm, tmp_path, "file/trace.json"))
  with pytest.raises(ValueError, match="cannot write the trace"):
    train_loop(config, comm, state, counted, batches, steps_per_epoch=2)
  assert not calls  # refused before the first step, on every rank
  path = shared_path(comm, tmp_path, "loop.json")
  monkeypatch.setenv(timeline_module.ENV, path)
  _, record = train_loop(config, comm, state, counted, batches, steps_per_epoch=2)
  trace = read_trace(comm, path)
  names = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
  assert {(r, n) for r in range(comm.size) for n in ("epoch 1", "step 0", "step 1")} <= names
  if comm.rank == 0:  # rank 0's record, as written to metrics.jsonl
    logged = json.loads(open(f"{workdir}/metrics.jsonl").read().splitlines()[-1])
    assert logged["straggler_report"]["steps"] == 2 and 0 <= logged["exchange_share"] <= 1
    assert record["wait_share"] == logged["wait_share"]
