"""ChainerMN's model-parallel MNIST MLP (experiments/model_parallel_mnist.py) over 2 and 3
ranks: a few steps, each rank's layers equal to the single-process model's (1e-5)."""

import re

import pytest
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


@pytest.mark.parametrize("ranks", [2, 3])
def test_model_parallel_mlp_trains_like_one_process(ranks):
  result = run_mpi(ranks, ["experiments/model_parallel_mnist.py", "--steps", "5", "--units",
                           "32", "--epochs", "1"], timeout=300)
  assert result.returncode == 0, result.stdout[-8000:]
  found = re.search(r"(\d+) steps on (\d) ranks; test accuracy ([\d.]+); max \|params -"
                    r" single-process params\| = (\S+)", result.stdout)
  assert found, result.stdout[-4000:]
  steps, size, _, error = found.groups()
  assert (int(steps), int(size)) == (5, ranks)
  assert float(error) <= 1e-5, result.stdout[-4000:]
