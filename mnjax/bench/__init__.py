"""Benchmarks: ``python -m mnjax.bench <name>``. Ratios are measured side by side in one run.

Available: ``step`` (overhead of `allreduce_gradients` in a train step; communication
efficiency at 2 ranks), ``kinds`` (communicator kinds on emulated multi-device nodes), and
``gpu``: the prepared check for a GPU machine (correctness of every kind, collective order,
ResNet step and allreduce figures in one time-boxed call; ``--smoke`` on a CPU).
"""
