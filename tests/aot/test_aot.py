"""The train step compiled for 2 H200 without a GPU (`lab.aot`): what its schedule proves.

A small model (two convolutions, BatchNorm, a classifier) on a 2-GPU topology: the first
gradient bucket's all-reduce starts before the last backward convolution; with double
buffering the exchange depends on none of the step's compute; `shard_optimizer`'s state per
device is 1/P in ``memory_analysis``; every process compiles the same collectives in the
same order; mpi4jax's CUDA custom calls compile. Each check has its control, where the same
check fails (the plain exchange depends on the backward pass, per-leaf waiting keeps the
MPI buckets after the last convolution, the unsharded state is whole).
"""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import optax
import pytest

import lab.runner
import mnjax
from lab import aot
from mnjax.comm._instep._allreduce import buckets_leave_early

REPO = Path(__file__).resolve().parents[2]
IMAGE = (8, 8, 3)


class Small(nn.Module):
  """Two convolutions with BatchNorm, then a classifier: several gradient leaves."""

  norm: object = nn.BatchNorm

  @nn.compact
  def __call__(self, x, train: bool = True):
    for width in (16, 32):
      x = nn.Conv(width, (3, 3), use_bias=False)(x)
      x = nn.relu(self.norm(use_running_average=not train)(x))
    return nn.Dense(10)(x.mean((1, 2)))


@pytest.fixture(scope="module")
def target():
  return aot.parse_target("2xH200")


def compiled(target, kind, tx_of, *, rank=0, batch=8, options=None):
  """(schedule, Compiled, the step's state) of `Small` trained with ``tx_of(comm)``."""
  per_process = 1 if aot.KIND_PROCESSES[kind] == "gpu" else target.gpus_per_node
  mesh = aot.mesh(target, per_process=per_process)
  comm = aot.communicator(kind, target, list(mesh.devices.flat), rank=rank)
  step, args = aot.train_step(comm, Small(), tx_of(comm), batch_per_gpu=batch,
                              image_shape=IMAGE, mesh=mesh if kind == "xla" else None)
  c = aot.compile(step, args, compiler_options=options)
  return aot.schedule(c.text, aot.parameter_outputs(step, args)), c, args[0]


def allreduce(comm, *, double_buffering=False):
  return mnjax.create_multi_node_optimizer(optax.sgd(0.1, momentum=0.9), comm,
                                           double_buffering=double_buffering, bucket_bytes=4096)


def test_targets_make_a_topology_of_processes(target):
  topo = aot.topology(target)
  assert [d.process_index for d in topo.devices] == [0, 1]
  assert "H200" in topo.devices[0].device_kind
  two_nodes = aot.topology("2x2xH200", per_process=2)
  assert [d.process_index for d in two_nodes.devices] == [0, 0, 1, 1]
  assert aot.mesh("4x8xH200").shape["batch"] == 32


def test_first_bucket_leaves_before_the_last_backward_convolution(target):
  """With XLA's combiner held to mnjax's buckets (4 kB here), the classifier's bucket starts
  while the convolutions' gradients are computed. XLA's default threshold (30 MB) combines
  this small model's buckets into one all-reduce, which must wait for the last of them."""
  held = {"xla_gpu_all_reduce_combine_threshold_bytes": 4096}
  s, _, _ = compiled(target, "xla", allreduce, options=held)
  assert len(s.gradients) > 1 and s.last_heavy > 0
  assert min(c.position for c in s.gradients) < s.last_heavy, s.gradients
  assert s.overlap() > 0  # XLA kept them asynchronous, with compute beside them
  combined, _, _ = compiled(target, "xla", allreduce)
  assert len(combined.gradients) == 1
  assert combined.gradients[0].position > combined.last_heavy


def test_mpi_buckets_leave_early_only_when_asked(target):
  """The same check on the flat kind's MPI custom calls, which can fail: waiting for every
  leaf (`buckets_leave_early(False)`) keeps the first bucket after the last convolution."""
  early, _, _ = compiled(target, "flat", allreduce)
  with buckets_leave_early(False):
    late, _, _ = compiled(target, "flat", allreduce)
  first = {name: min(c.position for c in s.gradients) for name, s in (("early", early),
                                                                       ("late", late))}
  assert first["early"] < early.last_heavy
  assert first["late"] > late.last_heavy
  assert early.overlap(mpi=True) == 0.0  # synchronous custom calls: nothing beside them


def test_double_buffered_exchange_depends_on_no_compute(target):
  double, _, _ = compiled(target, "xla", functools.partial(allreduce, double_buffering=True))
  plain, _, _ = compiled(target, "xla", allreduce)
  assert double.gradients and not any(c.depends_on_heavy for c in double.gradients)
  assert all(c.depends_on_heavy for c in plain.gradients)


def test_shard_optimizer_state_is_one_over_p_in_memory_analysis(target):
  def state_in_memory(c, state, batch_bytes):
    import jax

    fixed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        (state.params, state.batch_stats, state.step)))
    return c.memory["argument"] - fixed - batch_bytes

  batch_bytes = 8 * (8 * 8 * 3 * 4 + 4)
  _, whole, whole_state = compiled(target, "flat", lambda comm: lab.runner.guarded_optimizer(
      optax.adam(1e-3), comm, lab.runner.RunConfig(epochs=1, global_batch_size=16,
                                                     workdir="runs/x")))
  _, shard, shard_state = compiled(target, "flat", lambda comm: lab.runner.guarded_optimizer(
      optax.adam(1e-3), comm, lab.runner.RunConfig(epochs=1, global_batch_size=16,
                                                     workdir="runs/x", shard_optimizer=True)))
  ratio = state_in_memory(shard, shard_state, batch_bytes) / state_in_memory(
      whole, whole_state, batch_bytes)
  assert ratio == pytest.approx(1 / target.gpus, rel=0.02), ratio


def test_every_process_compiles_the_same_collectives_in_the_same_order(target):
  def adam(comm):
    return mnjax.shard_optimizer(optax.adam(1e-3), comm, bucket_bytes=4096)

  first, _, _ = compiled(target, "flat", adam, rank=0)
  last, _, _ = compiled(target, "flat", adam, rank=target.gpus - 1)
  assert first.sequence() and first.sequence() == last.sequence()
  xla = [compiled(target, "xla", lambda c: lab.runner.guarded_optimizer(
      optax.sgd(0.1), c, lab.runner.RunConfig(epochs=1, global_batch_size=16,
                                                workdir="runs/x")), rank=r)[0].sequence()
         for r in (0, target.gpus - 1)]
  assert xla[0] and xla[0] == xla[1]


def test_mpi_kinds_compile_mpi4jax_custom_calls():
  two_nodes = aot.parse_target("2x2xH200")
  for kind in ("flat", "two_dimensional"):
    s, _, _ = compiled(two_nodes, kind, allreduce)
    assert any("mpi_allreduce_ffi" in c.kind for c in s.collectives), kind


def test_unknown_gpu_and_bad_topology_list_the_known_ones():
  with pytest.raises(ValueError, match="known: H100, H200"):
    aot.parse_target("8xA100")
  with pytest.raises(ValueError, match="NODESxGPUSxNAME"):
    aot.parse_target("eight H200")


@pytest.mark.slow
def test_bench_quick_prints_the_summary_last(tmp_path):
  env = dict(os.environ)
  out = subprocess.run([sys.executable, "-m", "lab.bench", "aot", "--quick", "--out",
                        str(tmp_path / "aot.json")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=1500)
  assert out.returncode == 0, out.stderr[-3000:]
  last = out.stdout.strip().splitlines()[-1]
  assert re.fullmatch(
      r"aot summary: overlap_backprop=\d\.\d{3} overlap_double_buffering=\d\.\d{3}"
      r" overlap_plain_jax=\d\.\d{3} zero1_state_ratio=\d\.\d{3} max_batch_allreduce=-?\d+"
      r" max_batch_shard=-?\d+", last), last
  assert "zero1_state_ratio=0.500" in last  # 2 GPUs: each holds half of adam's moments
