"""`lab.augment`, the experiments' image preprocessing: each transform's shape, the center
crop's pixels, both flips, and a clear error for a dataset it has no recipe for."""

import numpy as np
import pytest

from lab import augment


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
