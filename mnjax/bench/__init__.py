"""Benchmarks: ``python -m mnjax.bench <name>``. Ratios are measured side by side in one run.

Available: ``step`` (overhead of `allreduce_gradients` in a train step; communication
efficiency at 2 ranks) and ``kinds`` (communicator kinds on emulated multi-device nodes).
"""
