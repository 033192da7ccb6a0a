"""Every bad-input case of tests/support/adversarial.py ends its job in under 30 s, with a
non-zero exit and the same clear message on every rank still running."""

import time

import pytest
from support.adversarial import CASES, LEAVING, classify, errors_by_rank
from support.launch import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

AT_THREE = ("sync_bn_one_more_layer", "sync_bn_no_layer_on_one_rank", "broadcast_other_root",
            "one_rank_leaves_during_broadcast")


@pytest.mark.parametrize("ranks, name", [(2, name) for name in CASES]
                         + [(3, name) for name in AT_THREE])
def test_bad_input_ends_the_job_quickly_with_one_message_on_every_rank(ranks, name):
  start = time.monotonic()
  result = run_mpi(ranks, ["tests/support/adversarial.py", name], timeout=60)
  seconds = time.monotonic() - start
  assert result.returncode != 0, result.stdout
  assert seconds < 30, result.stdout
  assert classify(result.returncode, result.stdout, ranks, LEAVING.get(name, 0)) == "clear", (
      result.stdout[-6000:])
  assert len(errors_by_rank(result.stdout)) == ranks - LEAVING.get(name, 0)


def test_the_classifier_tells_the_outcomes_apart():
  one = "[rank 0] ValueError: broadcast: the ranks disagree\n"
  both = one + "[rank 1] ValueError: broadcast: the ranks disagree\n"
  assert classify(None, "", 2) == "hang"
  assert classify(0, "", 2) == "silent"
  assert classify(1, both, 2) == "clear"
  assert classify(1, one, 2) == "one rank"
  assert classify(1, one + "[rank 1] ValueError: broadcast: other words\n", 2) == "one rank"
  assert classify(1, "Fatal error in PMPI_Allreduce: Message truncated\n", 2) == "unclear"
  assert classify(1, one, 2, leaving=1) == "clear"


@pytest.mark.parametrize("case, limit, says", [
    ("peer_finished", "30", "waits in an in-step recv with rank 1 (world rank 1, tag 0), but"
                            " rank 1 finished its program (exited normally)"),
    ("allreduce_peer_finished", "30", "rank 0 (world rank 0) waits in an in-step allreduce"
                                      " (tag 0), but rank 1 (world rank 1) finished its program"
                                      " (exited normally)"),
    ("peer_stalls", "3", "waited 3 s in an in-step recv with rank 1 (world rank 1, tag 0),"
                         " which has not done its part"),
    ("allreduce_peer_stalls", "3", "rank 0 (world rank 0) waited 3 s in an in-step allreduce"
                                   " (tag 0) of 2 ranks that not all of them have reached"),
    ("wire_peer_finished", "30", "rank 0 (world rank 0) waits in an in-step alltoall (tag 0),"
                                 " but rank 1 (world rank 1) finished its program"),
    ("bcast_peer_stalls", "3", "rank 1 (world rank 1) waited 3 s in an in-step bcast (tag 0)"
                               " of 2 ranks that not all of them have reached"),
    # Each rank names the two waits (the bound, 300 s, is not reached).
    ("step_meets_host_round", "300", (
        "world rank 0 waits in an in-step allreduce (tag 0) of 2 ranks, which needs world rank"
        " 1, while world rank 1 waits for this rank in bcast_obj's check of the root and its"
        " object: the two can never meet",
        "world rank 1 waits in bcast_obj's check of the root and its object, which needs world"
        " rank 0, while world rank 0 waits for this rank in an in-step allreduce (tag 0) of 2"
        " ranks: the two can never meet")),
    ("recv_meets_host_round", "300", (
        "world rank 0 waits in an in-step recv with world rank 1 (tag 0), which needs world"
        " rank 1, while world rank 1 waits for this rank in allreduce_obj",
        "world rank 1 waits in allreduce_obj")),
    ("host_rounds_in_another_order", "300", tuple(
        f"world rank {me} waits in bcast_obj's check of the root and its object, which needs"
        f" world rank {1 - me}, while world rank {1 - me} waits for this rank in bcast_obj's"
        " check of the root and its object: the two can never meet (two host operations"
        " that cannot be one" for me in (0, 1))),
    ("host_send_meets_recv_of_another_tag", "300", (
        "world rank 0 waits in send_obj (to rank 1, tag 1, waiting for its receive), which"
        " needs world rank 1, while world rank 1 waits for this rank in recv_obj (from rank 0,"
        " tag 2): the two can never meet",
        "world rank 1 waits in recv_obj (from rank 0, tag 2), which needs world rank 0, while"
        " world rank 0 waits for this rank in send_obj (to rank 1, tag 1, waiting for its"
        " receive): the two can never meet")),
])
def test_an_in_step_wait_that_cannot_complete_ends_the_job_naming_the_peer(case, limit, says):
  """Every in-step wait polls: a peer that exited ends it after a 2 s grace, one that stays
  silent after MNJAX_WAIT_TIMEOUT, and one that waits for this rank where the wait can never
  meet it (a step against a host round; host operations of two communicators, or of a
  message's two ends with other tags) after about 10 s (the wait notices), with no watchdog
  (tests/support/instep_waits.py)."""
  start = time.monotonic()
  result = run_mpi(2, ["tests/support/instep_waits.py", case], timeout=60,
                   env={"MNJAX_WAIT_TIMEOUT": limit})
  for line in (says,) if isinstance(says, str) else says:
    assert result.returncode != 0 and line in result.stdout, result.stdout[-4000:]
  assert "rank 0: returned normally" not in result.stdout
  assert time.monotonic() - start < 30, result.stdout[-4000:]


def test_a_rank_stuck_in_its_own_code_is_named_at_the_bound_by_every_waiting_rank():
  """A host round's wait is bounded by default (``MNJAX_WAIT_TIMEOUT``); at the bound each
  waiting rank names the ranks waiting with it and the one that never came (alive: in its own
  code), from the wait notices (tests/support/instep_waits.py, ``stuck_in_own_code``)."""
  start = time.monotonic()
  result = run_mpi(3, ["tests/support/instep_waits.py", "stuck_in_own_code"], timeout=60,
                   env={"MNJAX_WAIT_TIMEOUT": "12"})
  assert result.returncode != 0 and time.monotonic() - start < 30, result.stdout[-4000:]
  for me in (0, 1):
    for line in (f"world rank {me} waited 12 s in bcast_obj's check of the root and its object",
                 f"Waiting in it too: world ranks [{1 - me}]; not in it: world ranks [2], alive"):
      assert line in result.stdout, result.stdout[-4000:]
  assert "returned normally" not in result.stdout
