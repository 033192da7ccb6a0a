"""The `xla` kind (jax.distributed + gloo) under mpirun, in fresh processes
(tests/support/xla_worker.py)."""

import pytest
from support.launch import run_mpi, xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]


@pytest.mark.parametrize("ranks", [2, 3])
def test_xla_kind_under_mpirun(ranks):
  result = run_mpi(
      ranks, ["tests/support/xla_worker.py"], timeout=300,
      env={"XLA_FLAGS": xla_flags(2)},
  )
  assert result.returncode == 0, result.stdout[-8000:]
  assert result.stdout.count("XLA OK") == ranks, result.stdout[-8000:]
