"""Runs tests/distributed/ under `mpirun -n 2` and `-n 3` (and the model-parallel files under
`-n 4`), each under a hard timeout.

These launches mostly compile (hundreds of small programs, a few steps each), with LLVM's
optimisations off as every launch of the suite (`support.launch.COMPILE_FAST`)."""

import pytest
from support.distributed_suite import assert_every_rank_passed, pytest_args
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


# At 3 ranks the suite runs only the files where a third rank proves what 2 cannot: an odd
# number of replicas (sums, means and 16-bit rounding over 3; shares of a leaf that 3 does
# not divide; ZeRO state resharded to another count), a rank that is neither first nor last
# (roots in the middle, sub-communicators of unequal sizes, point-to-point exchanges), and a
# mismatch on one rank of several. What is the same at any count above 1 (checkpoints, the
# loop, the guards' messages, the multi-device kinds' equivalences) runs at 1 and 2 ranks;
# the model-parallel graph, the N-step RNN and the collectives with per-rank shapes run at 4
# (two middle ranks, and one that holds no stage), not again at 3.
AT_3 = tuple(f"tests/distributed/{name}.py" for name in (
    "test_agreement", "test_collectives", "test_exact_replicas", "test_functions",
    "test_host", "test_host_collectives", "test_iterators", "test_local_sgd", "test_preflight",
    "test_scatter_root", "test_shard", "test_shard_checkpoint", "test_sharding", "test_split",
    "test_wire"))
# SyncBatchNorm over 3 replicas (an odd count), flat kind only: its statistics, gradients and
# steps against the global batch, and its persistent averages. The multi-device kinds cost
# minutes at 3 x 2 emulated devices on 2 cores and prove nothing 2 x 2 does not.
BATCH_NORM_AT_3 = tuple(f"tests/distributed/test_batch_norm.py::{name}" for name in (
    "test_forward_statistics_and_gradients_equal_batch_norm_on_the_global_batch[flat]",
    "test_sgd_steps_keep_replicas_identical_and_match_single_process[flat]",
    "test_allreduce_persistent_averages_running_statistics",
    "test_allreduce_persistent_mismatch_raises_on_every_rank"))


# 240 s on a quiet machine; beside the other pytest worker in CI, 570-620 s: past the
# suite's default per-test limit (run_mpi's own 900 s ends a hang).
@pytest.mark.timeout(900)
def test_distributed_suite_under_mpirun_2():
  result = run_mpi(2, pytest_args(), timeout=900)
  # Every rank ran the suite and none skipped everything.
  assert_every_rank_passed(result, 2)


@pytest.mark.timeout(900)
def test_distributed_suite_under_mpirun_3():
  result = run_mpi(3, pytest_args(AT_3 + BATCH_NORM_AT_3), timeout=900)
  assert_every_rank_passed(result, 3)


def test_model_parallel_under_mpirun_4():
  """The model-parallel graph, the N-step RNN and the collectives with per-rank shapes at 4
  ranks (one rank runs no stage of the graph)."""
  files = tuple(f"tests/distributed/{name}.py" for name in (
      "test_multi_node_chain", "test_multi_node_rnn", "test_functions_parts"))
  result = run_mpi(4, pytest_args(files), timeout=600)
  assert_every_rank_passed(result, 4, at_least=20)
