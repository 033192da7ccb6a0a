"""Compiling for GPUs that are not here: the real train step, ahead of time, without a device.

Nothing on this project's machines is a GPU; XLA compiles for one anyway from a description
of it (jaxlib's CUDA plugin, no GPU, driver or toolkit: ``MNJAX_EXTRAS=cuda
MNJAX_VENV=.venv-cuda scripts/setup.sh``). What XLA's GPU passes then decide (how the
gradient exchange is combined and scheduled beside the backward pass, and how much memory a
step needs) is read from the compiled program: ``python -m lab.bench aot``.

* `parse_target`, `topology`, `mesh`: ``"8xH200"`` / ``"4x8xH200"`` (nodes x GPUs) as a JAX
  topology and mesh; the GPUs are text protos in ``lab/aot/targets/`` (`gpu_names`).
* `communicator`: the `mnjax.Communicator` a rank of that job would hold, built without the
  job (`PlaysEveryRank` answers its host-level comparisons).
* `train_step`, `compile`: the step `lab.runner.make_train_step` runs for the kind, lowered
  on abstract arguments and compiled: scheduled HLO, memory per GPU, flops and bytes.
* `schedule`: the compiled program's collectives in schedule order, with what runs beside
  each and which are gradient exchanges.

Example::

    target = lab.aot.parse_target("8xH200")
    mesh = lab.aot.mesh(target)
    comm = lab.aot.communicator("xla", target, mesh.devices.flat)
    step, args = lab.aot.train_step(comm, model, tx, batch_per_gpu=32,
                                      image_shape=(224, 224, 3), mesh=mesh)
    print(lab.aot.schedule(lab.aot.compile(step, args).text).overlap())
"""

from lab.aot._communicator import KIND_PROCESSES, PlaysEveryRank, communicator
from lab.aot._compile import Compiled, abstract, compile, parameter_outputs, train_step
from lab.aot._schedule import Collective, Schedule, schedule, shape_bytes
from lab.aot._targets import (
    INSTALL,
    AotUnavailable,
    Target,
    gpu_names,
    mesh,
    parse_target,
    plugin_installed,
    target_config,
    topology,
)

__all__ = [
    "INSTALL",
    "KIND_PROCESSES",
    "AotUnavailable",
    "Collective",
    "Compiled",
    "PlaysEveryRank",
    "Schedule",
    "Target",
    "abstract",
    "communicator",
    "compile",
    "gpu_names",
    "mesh",
    "parameter_outputs",
    "parse_target",
    "plugin_installed",
    "schedule",
    "shape_bytes",
    "target_config",
    "topology",
    "train_step",
]
