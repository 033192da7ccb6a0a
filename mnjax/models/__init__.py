"""Flax models used by mnjax's experiments, tests and benchmarks."""

from mnjax.models.cnn import SmallCNN

__all__ = ["SmallCNN"]
