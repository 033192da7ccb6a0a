"""Two emulated nodes x two ranks (``MNJAX_EMULATE_NODES=2``, ``mpirun -n 4``, two CPU
devices per process): node-local ranks, node counts, device selection and every kind."""

import re

import pytest
from support.launch import run_mpi, xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

RANKS = 4
ENV = {"MNJAX_EMULATE_NODES": "2", "XLA_FLAGS": xla_flags(2)}


# xla starts jax.distributed, which reroutes every CPU collective of its process: own launch.
@pytest.mark.parametrize("kinds", [["flat", "hierarchical", "two_dimensional"], ["xla"]])
def test_every_kind_at_two_nodes_of_two_ranks(kinds):
  result = run_mpi(RANKS, ["tests/support/emulated_nodes_worker.py", *kinds], timeout=300, env=ENV)
  assert result.returncode == 0, result.stdout[-8000:]
  for kind in kinds:
    ok = re.findall(rf"OK {kind} rank (\d) node (\d)", result.stdout)
    assert sorted(ok) == [(str(r), str(r // 2)) for r in range(RANKS)], result.stdout[-4000:]


def test_emulated_nodes_must_divide_the_ranks():
  result = run_mpi(3, ["tests/support/emulated_nodes_worker.py", "flat"], timeout=120,
                   env={**ENV, "MNJAX_EMULATE_NODES": "2"})
  assert result.returncode != 0
  # every rank says why
  assert (result.stdout.count("must be a positive number of emulated nodes") >= 3
          ), result.stdout[-4000:]
