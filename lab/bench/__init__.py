"""Benchmarks: ``python -m lab.bench <name> [options]``, ratios measured side by side in one run.

Each benchmark re-launches itself under ``mpirun`` where it needs several ranks (``--help``
per benchmark), prints a table and writes JSON to ``runs/bench/<name>.json`` (``--out``);
the dated results are in docs/results/, the JSON they come from in docs/results/bench/.

* ``python -m lab.bench allreduce``: one float32 buffer from 4 B to 128 MB on 2 ranks,
  every method side by side (raw MPI on numpy buffers, mpi4jax, mnjax in fp32 and over a
  16-bit wire, JAX's own psum), then ResNet-50's 161 gradient leaves reduced per leaf, in
  buckets and fused.
* ``python -m lab.bench step``: the cost of `allreduce_gradients` in the digits CNN train
  step: the overhead on a size-1 communicator (against plain optax) and the communication
  efficiency at 2 ranks (against the same step with no communication, and the naive
  ``mpi4jax.allreduce`` baseline).
* ``python -m lab.bench kinds``: the communicator kinds on emulated multi-device nodes
  (2 processes x 2 devices): gradient reduction time (digits CNN, ResNet-50-sized) and step
  efficiency against a step that averages over the local devices only.
* ``python -m lab.bench resnet``: ResNet-50 training throughput on synthetic images at 1
  rank (plain flax + optax against mnjax with SyncBatchNorm: the overhead) and 2 ranks
  (SyncBatchNorm or per-rank BatchNorm with `allreduce_gradients`, against no
  communication: communication and weak-scaling efficiency).
* ``python -m lab.bench checks``: what the default-on safety checks cost the digits CNN
  step at 2 ranks (`skip_nonfinite`, the `Watchdog`, `raise_if_diverging`; `check_replicas`
  per call and per epoch).
* ``python -m lab.bench scaling``: communication and weak-scaling efficiency of the digits
  CNN step at 1, 2, 3 and 4 ranks, for `notebooks/scaling` and the cost model's calibration.
* ``python -m lab.bench gpu``: the prepared check for a GPU machine, time-boxed to one
  call: devices per rank, every kind's averaged gradients against ``flat`` and a float64
  reference, the compiled order of collectives on each rank, a ResNet-50 step against plain
  flax + optax, the allreduce sweep and SyncBatchNorm's share of the step (``--smoke`` on a
  CPU, as CI runs it).
* ``python -m lab.bench zero``: `shard_optimizer` (ZeRO-1) against
  ``chain(allreduce_gradients, adam)`` at 1, 2 and 3 ranks: optimizer-state bytes per rank
  and step time, on the digits CNN train step and on a ResNet-50-sized tree (the update
  step only).
* ``python -m lab.bench aot``: the experiments' ResNet-50 step compiled for 8 and 4x8 H200
  without a GPU (`lab.aot`; the CUDA plugin's venv): overlap of the gradient exchange,
  combining, memory per GPU and the largest batch, collective order, the MPI kinds and plain
  ``jax.jit`` side by side, from the compiled schedule (``--quick`` for tests).
* ``python -m lab.bench cluster``: the gradient exchange between emulated nodes over
  shaped links (`lab.cluster`, needs root): unshaped, 1 and 10 Gbit/s, 2 and 4 nodes; per
  kind and wire the uplink bytes and exchange time, measured and predicted by
  `lab.costmodel.link` fitted on the same link; then the digits CNN and a ResNet-10 step
  per kind at 1 Gbit/s, with double buffering and backprop-order buckets against plain
  (``--parts step``: that part alone).
"""
