"""mnjax's lab: what measures, emulates, compiles for absent hardware and runs the experiments.

Run from the checkout root (it is not installed with ``pip install mnjax``); it imports
`mnjax`, never the other way round.

* `lab.bench` — the benchmarks: ``python -m lab.bench NAME``;
* `lab.cluster` — nodes emulated in network namespaces on shaped links:
  ``python -m lab.cluster run ...``;
* `lab.aot` — the train step compiled for GPUs that are not here;
* `lab.costmodel` — the alpha-beta model that predicts scaling beyond this machine;
* `lab.timeline` — the viewer for ``MNJAX_TIMELINE`` traces: ``python -m lab.timeline view``;
* `lab.models` — the reference models (a small CNN, ResNets);
* `lab.augment` — the experiments' image preprocessing (crops, flips, normalisation);
* `lab.runner` — the experiments' classifier, guarded epoch loop, flags and work directory.
"""
