"""Whatever decides which examples a rank reads is agreed across ranks: a seed,
epoch, dataset size, batch or option that differs on one rank is named on every rank, before
anything is read; one host round per call, none at size 1, none per batch."""

import re

import numpy as np
import pytest

import mnjax
from mnjax.data import Loader, _agreement, open_source


@pytest.fixture(autouse=True)
def collectives_still_line_up(comm):
  """After each error every rank must still be in step (a rank left inside the check's
  allgather would make this allreduce hang)."""
  yield
  assert comm.mpi_comm.allreduce(1) == comm.size


def _ranks(ranks):
  if len(ranks) == 1:
    return f"rank {ranks[0]}"
  return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def expected_difference(comm, label, usual, odd):
  """The text every rank must see when the last rank passes `odd` and the others `usual`."""
  return f"{label} {usual} on {_ranks(list(range(comm.size - 1)))}, {odd} on rank {comm.size - 1}"


def source(n):
  return open_source("synthetic", "train", image_size=4, synthetic_size=n)


def identity(image, rng):
  return image


N = 60  # a multiple of every global batch below at 2 and 3 ranks: only the odd value differs

# (case id, call(comm, value), label in the message, the other ranks' value, the last rank's)
CASES = [
    ("scatter_index-seed",
     lambda comm, v: mnjax.scatter_index(N, comm, shuffle=True, seed=v), "seed", 1, 2),
    ("scatter_index-epoch",
     lambda comm, v: mnjax.scatter_index(N, comm, shuffle=True, epoch=v), "epoch", 0, 1),
    ("scatter_index-n", lambda comm, v: mnjax.scatter_index(v, comm), "dataset size", N, N - 1),
    ("scatter_index-shuffle",
     lambda comm, v: mnjax.scatter_index(N, comm, shuffle=v), "shuffle", True, False),
    ("scatter_index-force_equal_length",
     lambda comm, v: mnjax.scatter_index(N + 1, comm, force_equal_length=v),
     "force_equal_length", True, False),
    ("scatter_dataset-n",
     lambda comm, v: mnjax.scatter_dataset(np.arange(v), comm), "dataset size", N, N + 1),
    ("scatter_dataset-seed",
     lambda comm, v: mnjax.scatter_dataset(list(range(N)), comm, shuffle=True, seed=v),
     "seed", 5, 6),
    ("epoch_batches-seed",  # the case: 68 digits read twice and 68 never, silently
     lambda comm, v: mnjax.epoch_batches(N, comm, 2 * comm.size, shuffle=True, seed=v),
     "seed", 1, 2),
    ("epoch_batches-epoch",
     lambda comm, v: mnjax.epoch_batches(N, comm, 2 * comm.size, shuffle=True, epoch=v),
     "epoch", 3, 4),
    ("epoch_batches-n",
     lambda comm, v: mnjax.epoch_batches(v, comm, 2 * comm.size, shuffle=True),
     "dataset size", N, N - 12),
    ("epoch_batches-global_batch_size",
     lambda comm, v: mnjax.epoch_batches(N, comm, v * comm.size, shuffle=True),
     "global_batch_size", None, None),  # filled in below: depends on comm.size
    ("epoch_batches-drop_remainder",
     lambda comm, v: mnjax.epoch_batches(N + 1, comm, 2 * comm.size, shuffle=False,
                                         drop_remainder=v),
     "drop_remainder", True, False),
    ("Loader-seed",
     lambda comm, v: Loader(source(N), comm, 2, identity, train=True, seed=v), "seed", 0, 7),
    ("Loader-n",
     lambda comm, v: Loader(source(v), comm, 2, identity, train=True), "dataset size", N, N + 6),
    ("Loader-batch_size",
     lambda comm, v: Loader(source(N), comm, v, identity, train=True), "batch_size", 2, 4),
    ("Loader-train",
     lambda comm, v: Loader(source(N), comm, 2, identity, train=v), "train", True, False),
    ("Loader.epoch-epoch",
     lambda comm, v: Loader(source(N), comm, 2, identity, train=True).epoch(v), "epoch", 1, 2),
    ("Loader.epoch-start",
     lambda comm, v: Loader(source(N), comm, 2, identity, train=True).epoch(0, start=v),
     "start", 0, 1),
]


@pytest.mark.parametrize("call,label,usual,odd", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_value_that_differs_on_one_rank_is_named_on_every_rank(comm, call, label, usual, odd):
  if comm.size == 1:
    pytest.skip("needs several ranks: one of them passes another value")
  if label == "global_batch_size":
    usual, odd = 2, 4  # the call multiplies by comm.size
    text = expected_difference(comm, label, usual * comm.size, odd * comm.size)
  else:
    text = expected_difference(comm, label, usual, odd)
  mine = odd if comm.rank == comm.size - 1 else usual
  with pytest.raises(ValueError, match=re.escape(text)) as error:
    call(comm, mine)
  message = str(error.value)
  assert "the same" in message and "on every rank" in message  # and how to fix it
  assert "read twice" in message  # what it would have cost
  # The same message on every rank.
  assert len(set(comm.mpi_comm.allgather(message))) == 1


def test_equal_values_of_other_types_agree(comm):
  """A numpy integer on one rank and a Python int on another are the same seed."""
  seed = np.int64(3) if comm.rank % 2 else 3
  a = mnjax.scatter_index(N, comm, shuffle=True, seed=seed, epoch=np.int32(1))
  np.testing.assert_array_equal(a, mnjax.scatter_index(N, comm, shuffle=True, seed=3, epoch=1))


def test_a_dataset_size_that_differs_names_the_data_as_the_fix(comm):
  if comm.size == 1:
    pytest.skip("needs several ranks: one of them holds a shorter dataset")
  with pytest.raises(ValueError, match=r"the same dataset, in full"):
    mnjax.scatter_index(N - (comm.rank == 0), comm)


def test_one_round_per_call_none_per_batch_and_none_at_size_one(comm, monkeypatch):
  rounds = []
  real = _agreement.gather_if_different

  def counting(*args, **kwargs):
    rounds.append(kwargs.get("what"))
    return real(*args, **kwargs)

  monkeypatch.setattr(_agreement, "gather_if_different", counting)
  for _ in mnjax.epoch_batches(N, comm, 2 * comm.size, shuffle=True):  # several batches
    pass
  mnjax.scatter_index(N, comm, shuffle=True)
  mnjax.scatter_dataset(np.arange(N), comm)
  mnjax.local_batch_size(2 * comm.size, comm)  # pure arithmetic: no round
  loader = Loader(source(N), comm, 2, identity, train=True)
  batches = list(loader.epoch(0))
  assert len(batches) > 1
  loader.steps(), loader.indices(0)  # local views of the plan: no round
  assert len(rounds) == (0 if comm.size == 1 else 5), rounds
