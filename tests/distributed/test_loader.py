"""The sharded input pipeline: the training order of epoch_batches, exactly once per epoch
over ranks when evaluating, deterministic, prefetched; the one dataset registry.

Runs in one process and under mpirun -n 2 (tests/jobs/test_mpirun.py); tensorflow-datasets
sources are replaced by `tfds.testing.mock_data` (nothing can be downloaded here).
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import mnjax
from lab import augment
from mnjax.data import Loader, open_source

N = 37  # not a multiple of any rank count or batch size


def gathered(comm, values):
  return np.concatenate(comm.mpi_comm.allgather(np.asarray(values)))


@pytest.fixture(params=["cifar10", "mnist", "imagenet2012"])
def mocked(request):
  with tfds.testing.mock_data(num_examples=N):
    yield open_source(request.param, "train")


def test_eval_loader_yields_every_example_exactly_once_over_ranks(comm, mocked):
  _, evaluate = augment.transforms(mocked.name, image_size=16)
  loader = Loader(mocked, comm, 4, evaluate, train=False)
  seen, shapes = [], set()
  for batch in loader.epoch(0):
    seen.append(batch.indices[batch.mask])
    shapes.add(batch.images.shape)
    first = int(batch.indices[0])  # the images are the source's, preprocessed
    np.testing.assert_array_equal(batch.images[0], evaluate(mocked[first][0], None))
    assert batch.labels[0] == mocked[first][1]
  everyone = gathered(comm, np.concatenate(seen))
  assert sorted(everyone.tolist()) == list(range(N))
  assert len(shapes) == 1  # one static shape: the last batch is padded, not short
  # Every rank runs the same number of steps: padded global batches, not per-rank shards.
  assert set(comm.mpi_comm.allgather(len(seen))) == {loader.steps()} == {-(-N // (4 * comm.size))}


def test_train_loader_is_deterministic_and_equal_length(comm, mocked):
  train, _ = augment.transforms(mocked.name, image_size=16)
  a = list(Loader(mocked, comm, 2, train, train=True, seed=3, workers=1).epoch(5))
  b = list(Loader(mocked, comm, 2, train, train=True, seed=3, workers=4, prefetch=1).epoch(5))
  c = list(Loader(mocked, comm, 2, train, train=True, seed=3).epoch(6))
  assert len(a) == len(b) and a and all(x.mask.all() for x in a)
  for x, y in zip(a, b):  # same seed and epoch: same examples, same augmentation
    np.testing.assert_array_equal(x.indices, y.indices)
    np.testing.assert_array_equal(x.images, y.images)
  assert not all(np.array_equal(x.indices, z.indices) for x, z in zip(a, c))
  # Every rank runs the same number of steps (full global batches), and no example is read
  # twice in an epoch.
  assert set(comm.mpi_comm.allgather(len(a))) == {N // (2 * comm.size)}
  used = gathered(comm, np.concatenate([x.indices for x in a]))
  assert len(used) == len(set(used.tolist())) == N // (2 * comm.size) * 2 * comm.size


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_loader_reads_in_the_order_of_epoch_batches(comm, train):
  # One order for both paths (experiments/imagenet.py and experiments/train.py): the loader's
  # batches are epoch_batches' (indices, mask) for the same global batch, seed and epoch.
  source = open_source("synthetic", "train", image_size=4, synthetic_size=N)
  loader = Loader(source, comm, 2, lambda image, rng: image, train=train, seed=9)
  expected = list(mnjax.epoch_batches(N, comm, 2 * comm.size, shuffle=train, seed=9, epoch=3,
                                      drop_remainder=train))
  batches = list(loader.epoch(3))
  assert len(batches) == len(expected) == loader.steps(3)
  for batch, (idx, mask) in zip(batches, expected):
    np.testing.assert_array_equal(batch.indices, idx)
    np.testing.assert_array_equal(batch.mask, mask)
  flat_idx, flat_mask = loader.indices(3)
  np.testing.assert_array_equal(flat_idx, np.concatenate([i for i, _ in expected]))
  np.testing.assert_array_equal(flat_mask, np.concatenate([m for _, m in expected]))
  # Resuming mid-epoch yields the remaining batches, unread ones skipped.
  rest = list(loader.epoch(3, start=2))
  assert [b.indices.tolist() for b in rest] == [b.indices.tolist() for b in batches[2:]]


def test_loader_checks_its_batch_at_construction(comm):
  source = open_source("synthetic", "train", image_size=4, synthetic_size=2 * comm.size)
  with pytest.raises(ValueError, match="no full global batch"):
    Loader(source, comm, 4, lambda image, rng: image, train=True)
  several = mnjax.create_communicator("hierarchical")  # conftest: two devices per process
  devices = several.local_device_count
  if devices > 1:
    with pytest.raises(ValueError, match=f"multiple of the {devices} local device"):
      Loader(source, several, devices + 1, lambda image, rng: image, train=False)


class Empty:
  def __len__(self):
    return 0

  def __getitem__(self, index):
    raise IndexError(index)


def test_loader_refuses_an_empty_source_but_evaluates_one_smaller_than_the_ranks(comm):
  for train in (True, False):  # nothing to train or evaluate on: said at construction
    with pytest.raises(ValueError, match=r"Loader: the dataset is empty \(0 examples\)"):
      Loader(Empty(), comm, 1, lambda image, rng: image, train=train)
  # One example over every rank (ChainerMN scatters it too): one padded step, counted once.
  loader = Loader(source := open_source("synthetic", "test", image_size=4, synthetic_size=1),
                  comm, 1, lambda image, rng: image, train=False)
  batches = list(loader.epoch(0))
  assert len(batches) == loader.steps() == 1 and batches[0].images.shape == (1, 4, 4, 3)
  assert gathered(comm, batches[0].indices[batches[0].mask]).tolist() == [0]
  if comm.size > 1:  # training on it: no full global batch
    with pytest.raises(ValueError, match="no full global batch"):
      Loader(source, comm, 1, lambda image, rng: image, train=True)


def test_loader_stops_cleanly_and_reports_worker_errors(comm):
  source = open_source("synthetic", "train", image_size=8, synthetic_size=64)
  train, _ = augment.transforms("synthetic", image_size=8)
  loader = Loader(source, comm, 4, train, train=True)
  for i, batch in enumerate(loader.epoch(0)):  # leaving early joins the producer
    assert batch.images.shape == (4, 8, 8, 3) and batch.images.dtype == np.float32
    if i == 1:
      break
  assert loader.wait_seconds >= 0

  def broken(image, rng):
    raise OSError("corrupt JPEG")

  with pytest.raises(RuntimeError, match=f"rank {comm.rank}: corrupt JPEG"):
    list(Loader(source, comm, 4, broken, train=True).epoch(0))


def test_synthetic_and_digits_sources():
  synthetic = open_source("synthetic", "train", image_size=12, synthetic_size=10)
  image, label = synthetic[7]
  assert image.shape == (12, 12, 3) and image.dtype == np.uint8 and label == 7
  np.testing.assert_array_equal(image, synthetic[7][0])  # the same on every call
  digits = open_source("digits", "test")
  assert len(digits) == 359 and digits.num_classes == 10 and digits[0][0].shape == (8, 8, 1)
  assert digits[0][0].dtype == np.uint8 and digits[0][0].max() <= 255


def test_in_memory_split_is_a_view_of_the_source():
  # One digits loader: load / load_digits are the Source's images / 255, its labels.
  source = open_source("digits", "train")
  split = mnjax.data.load_digits("train")
  assert len(split) == len(source) == 1438 and split.num_classes == 10
  assert split.images.dtype == np.float32 and split.labels.dtype == np.int32
  for i in (0, 17, 1437):
    image, label = source[i]
    np.testing.assert_array_equal(split.images[i], image.astype(np.float32) / 255)
    assert split.labels[i] == label
  assert split.images.min() == 0 and split.images.max() == 1
  # The stratified split is fixed: every class in both splits, about 20% in test.
  test = mnjax.data.load("digits", "test")
  assert len(test) == 359 and set(test.labels.tolist()) == set(range(10))
  np.testing.assert_array_equal(mnjax.data.as_split(open_source("digits", "test")).images,
                                test.images)


def test_in_memory_split_of_a_tfds_source():
  with tfds.testing.mock_data(num_examples=N):
    split = mnjax.data.load("mnist", "train")
    source = open_source("mnist", "train")
  assert split.images.shape == (N, 28, 28, 1) and split.num_classes == 10
  np.testing.assert_array_equal(split.images[3], source[3][0] / np.float32(255))


def test_load_names_what_it_can_hold():
  with pytest.raises(ValueError, match="too large to hold in memory.*Loader"):
    mnjax.data.load("imagenet2012", "train")
  with pytest.raises(ValueError, match="unknown dataset 'svhn'; in-memory datasets: digits"):
    mnjax.data.load("svhn", "train")
  with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
    mnjax.data.load_digits("validation")


def test_missing_dataset_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"tfds build cifar10 --data_dir DIR"):
    open_source("cifar10", "train", data_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="downloads/manual"):
    open_source("imagenet2012", "test", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
    open_source("imagenet", "train")


def test_missing_tensorflow_datasets_names_the_extra(monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "tensorflow_datasets", None)
  with pytest.raises(ImportError, match=r"mnjax\[data\]"):
    open_source("mnist", "train")
