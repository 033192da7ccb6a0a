"""Data x model parallelism from `comm.split` (ChainerMN's dual parallel): one ``mpirun -n 4``
job, two emulated nodes (`tests/support/dual_parallel_worker.py` says what it checks)."""

import re

import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


def test_two_stages_times_two_replicas_train_like_one_process(tmp_path):
  result = run_mpi(4, ["tests/support/dual_parallel_worker.py", str(tmp_path)], timeout=300,
                   env={"MNJAX_EMULATE_NODES": "2"})
  assert result.returncode == 0, result.stdout[-8000:]
  ok = re.findall(r"OK rank (\d) stage (\d) replica (\d)", result.stdout)
  assert sorted(ok) == [(str(r), str(r % 2), str(r // 2)) for r in range(4)], result.stdout[-4000:]
  assert "OK a receive from a peer that finished is an error" in result.stdout
  assert "mnjax: jax.process_index" not in result.stdout  # orbax on a group's root is mnjax's
