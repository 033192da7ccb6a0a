"""multi_node_early_stopping: ChainerMN's MultiNodeEarlyStoppingTrigger test, translated.

Two steps per epoch, a check per epoch; each rank observes the accuracies scaled by
``1 - rank / size`` (so the ranks disagree; their mean decides), and the stop comes at the
same check on every rank, where ChainerMN's test expects it.
"""

import math

import numpy as np
import pytest

import mnjax

ACCURACIES = [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 0.6, 0.6, 0.4, 0.4, 0.3, 0.3, 0.2, 0.2]
EXPECTED = [False, False, False, False, False, False, False, False, False, False, False,
            False, False, True, False, True]  # checked at every second step


def test_chainermns_trigger_test(comm):
  stopper = mnjax.train.multi_node_early_stopping(comm, monitor="main/accuracy", patience=3)
  state = stopper.init()
  fired = []
  for step, accuracy in enumerate(ACCURACIES):
    state = stopper.observe(state, np.float32(accuracy * (1 - comm.rank / comm.size)))
    if step % 2 == 1:  # the end of an epoch: check
      state = stopper.check(state)
      fired.append(state.stop)
    else:
      fired.append(False)
  assert fired == EXPECTED
  scale = np.mean([1 - r / comm.size for r in range(comm.size)])
  assert math.isclose(state.best, 0.7 * scale, rel_tol=1e-6)
  assert comm.mpi_comm.allgather(fired) == [fired] * comm.size


def test_the_mean_of_all_observations_decides(comm):
  # loss: minimised. Rank 0 observes twice per check, the others once: a mean of means would
  # weight them alike; ChainerMN averages every observation.
  stopper = mnjax.train.multi_node_early_stopping(comm, patience=1)
  state = stopper.init()
  for value in ([1.0, 3.0] if comm.rank == 0 else [5.0]):
    state = stopper.observe(state, value)
  state = stopper.check(state)
  assert state.best == (4.0 + 5.0 * (comm.size - 1)) / (comm.size + 1)
  with pytest.warns(UserWarning, match="no rank observed loss"):
    state = stopper.check(state)  # nothing observed: nothing compared
  assert not state.stop
  state = stopper.check(stopper.observe(state, float("nan")))  # NaN never improves
  assert state.stop and state.bad_checks == 1


def test_bad_input(comm):
  with pytest.raises(ValueError, match="patience must be a positive int"):
    mnjax.train.multi_node_early_stopping(comm, patience=0)
  with pytest.raises(ValueError, match="mode must be one of"):
    mnjax.train.multi_node_early_stopping(comm, mode="best")
  stopper = mnjax.train.multi_node_early_stopping(comm)
  with pytest.raises(TypeError, match="observe takes one real number"):
    stopper.observe(stopper.init(), np.ones(2))
  if comm.size > 1:
    with pytest.raises(ValueError, match="every rank must pass the same patience"):
      mnjax.train.multi_node_early_stopping(comm, patience=2 + min(comm.rank, 1))
