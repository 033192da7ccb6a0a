"""The multi-node model end to end, one mpirun launch each:

* 2 ranks, tests/support/multi_node_model_job.py: ChainerMN's MNIST split (stages on ranks
  [0, 1, 0]) has the single-process loss and gradient, trains with per-stage optimizers to
  the single-process parameters, saves each rank's stage in one checkpoint
  (`mnjax.checkpoint.PerRankState`; the same tree unwrapped is refused, naming it) and
  resumes bitwise; GPipe over 4 micro-batches has the whole batch's gradient; a
  micro-batched chain that comes back to a rank is refused as a deadlock;
* 4 ranks, experiments/dual_parallel.py: data x model parallel (comm.split) trains to the
  single-process parameters (1e-5);
* 2 ranks, experiments/channel_parallel.py: the channel-parallel CNN, the same.
"""

import json

import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


def test_the_chain_its_checkpoint_and_gpipe_on_two_ranks(tmp_path):
  result = run_mpi(2, ["tests/support/multi_node_model_job.py", str(tmp_path)], timeout=400)
  assert result.returncode == 0, result.stdout[-5000:]
  lines = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("result-*.json"))]
  by_rank = {r["rank"]: r for r in lines}
  assert sorted(by_rank) == [0, 1], result.stdout[-3000:]
  assert by_rank[0]["stages"] == ["stage_0", "stage_2"] and by_rank[1]["stages"] == ["stage_1"]
  for r in by_rank.values():
    assert r["grad_error"] <= 1e-6 and r["loss_error"] <= 1e-6, r
    assert r["trained_error"] <= 1e-5, r
    assert r["plain_save"] == "refused naming PerRankState", r
    assert r["restored_step"] == 3 and r["restored_bitwise"] and r["resumed_bitwise"], r
    assert r["gpipe_error"] <= 1e-6, r
    assert r["cyclic_gpipe"] == "refused", r


@pytest.mark.parametrize(("ranks", "script", "what"), [
    (4, "experiments/dual_parallel.py", "dual parallel MLP (data x model)"),
    (2, "experiments/channel_parallel.py", "channel-parallel CNN"),
])
def test_the_ports_train_to_the_single_process_parameters(ranks, script, what):
  result = run_mpi(ranks, [script, "--steps", "15"], timeout=400)
  assert result.returncode == 0, result.stdout[-5000:]
  line = next((x for x in result.stdout.splitlines() if x.startswith(what)), None)
  assert line is not None, result.stdout[-3000:]
  assert f"15 steps on {ranks} ranks" in line
  error = float(line.split("single-process params| = ")[1].split()[0])
  assert error <= 1e-5, line
