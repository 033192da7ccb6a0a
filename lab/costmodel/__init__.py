"""A calibrated alpha-beta cost model of data-parallel training, validated on published runs.

No machine here has more than two cores; the road to 128-1024 GPUs is this model:

* `hardware`: links (InfiniBand FDR-NDR, 10-100 GbE, NVLink 1-5, PCIe) and cluster presets;
* `allreduce`: ring, recursive halving/doubling, hierarchical and two-dimensional allreduce,
  NCCL's double binary tree, and the time of each mnjax communicator kind;
* `step`: step time with or without overlap (backward, double buffering), wire dtype and
  bucketing, the bucket size of lowest step time, and weak-scaling efficiency;
* `published`: the published points the model must reproduce before it predicts;
* `calibrate`: link and software overhead fitted to ``python -m lab.bench allreduce``;
* `compiled`: compute time from the compiler's cost analysis and predictions from the
  compiled overlap share (``python -m lab.bench aot``);
* `link`: uplink bytes per exchange and alpha/beta fitted on an emulated link
  (``python -m lab.bench cluster``).

    >>> from lab import costmodel as cm
    >>> c = cm.hardware.cluster("mn_1", gpus=1024)
    >>> w = cm.step.RESNET50.replace(compute=0.1)
    >>> round(cm.step.efficiency(w, c, "two_dimensional"), 2)
    0.76
"""

from lab.costmodel import allreduce, calibrate, compiled, hardware, link, published, step
from lab.costmodel.hardware import Cluster, Link
from lab.costmodel.step import Software, StepTime, Workload, efficiency, step_time

__all__ = ["Cluster", "Link", "Software", "StepTime", "Workload", "allreduce", "calibrate",
           "compiled", "efficiency", "hardware", "link", "published", "step", "step_time"]
