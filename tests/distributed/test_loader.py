"""The sharded input pipeline: exactly once per epoch over ranks, deterministic, prefetched.

Runs in one process and under mpirun -n 2 and -n 3 (tests/test_mpirun.py); tensorflow-datasets
sources are replaced by `tfds.testing.mock_data` (nothing can be downloaded here).
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import mnjax
from mnjax.data import augment
from mnjax.data import _sources as sources
from mnjax.data import Loader

N = 37  # not a multiple of any rank count or batch size


def gathered(comm, values):
  return np.concatenate(comm.mpi_comm.allgather(np.asarray(values)))


@pytest.fixture(params=["cifar10", "mnist", "imagenet2012"])
def mocked(request):
  with tfds.testing.mock_data(num_examples=N):
    yield sources.open_source(request.param, "train")


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
  # Every rank runs the same number of steps, and the ranks' examples are disjoint
  # apart from ChainerMN's equal-length padding (at most one per rank).
  assert len(set(comm.mpi_comm.allgather(len(a)))) == 1
  used = gathered(comm, np.concatenate([x.indices for x in a]))
  assert len(used) - len(set(used.tolist())) <= comm.size


def test_loader_stops_cleanly_and_reports_worker_errors(comm):
  source = sources.open_source("synthetic", "train", image_size=8, synthetic_size=64)
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
  synthetic = sources.open_source("synthetic", "train", image_size=12, synthetic_size=10)
  image, label = synthetic[7]
  assert image.shape == (12, 12, 3) and image.dtype == np.uint8 and label == 7
  np.testing.assert_array_equal(image, synthetic[7][0])  # the same on every call
  digits = sources.open_source("digits", "test")
  assert len(digits) == 359 and digits.num_classes == 10 and digits[0][0].shape == (8, 8, 1)


def test_missing_dataset_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"tfds build cifar10 --data_dir DIR"):
    sources.open_source("cifar10", "train", data_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="downloads/manual"):
    sources.open_source("imagenet2012", "test", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
    sources.open_source("imagenet", "train")


def test_missing_tensorflow_datasets_names_the_extra(monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "tensorflow_datasets", None)
  with pytest.raises(ImportError, match=r"mnjax\[data\]"):
    sources.open_source("mnist", "train")


def test_image_transforms():
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (30, 50, 3), np.uint8)
  assert augment.random_resized_crop(image, rng, 16).shape == (16, 16, 3)
  assert augment.pad_and_random_crop(image, rng).shape == image.shape
  # Center crop of an image already at size/0.875: the middle, untouched.
  square = rng.integers(0, 256, (32, 32, 1), np.uint8)
  np.testing.assert_array_equal(augment.center_crop(square, 28), square[2:30, 2:30])
  flips = {augment.random_flip(image, np.random.default_rng(s))[0, 0, 0] for s in range(20)}
  assert flips == {image[0, 0, 0], image[0, -1, 0]}
  train, evaluate = augment.transforms("imagenet2012", image_size=24)
  assert train(image, rng).shape == evaluate(image, None).shape == (24, 24, 3)
  with pytest.raises(ValueError, match="no preprocessing"):
    augment.transforms("svhn")
