"""Flax models used by mnjax's experiments, tests and benchmarks."""

from lab.models._cnn import SmallCNN
from lab.models._resnet import (
    ResNet,
    ResNet6,
    ResNet10,
    ResNet18,
    ResNet34,
    ResNet50,
    ResNet101,
    ResNet152,
)

__all__ = ["ResNet", "ResNet6", "ResNet10", "ResNet18", "ResNet34", "ResNet50", "ResNet101",
           "ResNet152", "SmallCNN"]
