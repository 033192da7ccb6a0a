"""The real train step, compiled for a GPU job that is not running: text, memory, cost.

`train_step` builds what `lab.runner.make_train_step(comm)` runs for `comm`'s kind, as a
jitted function that can be *lowered* with abstract arguments on a topology's devices:

* ``xla``: the per-device step under ``jax.shard_map`` over every GPU of the job, the batch
  split along ``comm.axis_name`` and the state replicated (what `mnjax.data_parallel` maps
  for ``xla``), its metric sums one row per device;
* ``flat``: the per-device step jitted for one GPU (what `mnjax.data_parallel` jits);
* ``hierarchical``, ``two_dimensional``: the step mapped over one node's GPUs, the metric
  sums psummed over them (`lab.runner._classifier.step_for_kind`).

What differs from a real run: `mnjax.data_parallel` wraps the same function, adding host
work that is no part of the program (the ranks' pre-flight comparison, answered here by
`lab.aot.PlaysEveryRank`, and for ``xla`` the global arrays built from each process's
batch and the sum of the per-device metric rows afterwards); the state is not donated, as
in mnjax's own steps. XLA cannot autotune without the GPU: convolution algorithms (and
their workspace, part of ``temp``) are XLA's defaults, not the fastest a real run picks.

`compile` lowers and compiles a jitted function on abstract arguments and returns a
`Compiled`: the scheduled HLO text, `memory_analysis` per device, and the cost (the
deviceless executable has no ``cost_analysis``: flops come from XLA's cost analysis of the
lowered program, the per-device bytes from that of the compiled, fused one, both run by the
CPU client).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.runner._classifier import _train_step, create_train_state
from mnjax.comm._communicator import Communicator
from mnjax.comm._instep import _sequence as sequence

__all__ = ["Compiled", "abstract", "compile", "parameter_outputs", "train_step"]


def abstract(tree: Any, sharding) -> Any:
  """`tree`'s leaves as ``jax.ShapeDtypeStruct``s placed by `sharding` (a callable of the
  leaf, or one sharding for all).

  Example:
    >>> abstract({"w": jnp.ones(3)}, None)["w"].shape
    (3,)
  """
  pick = sharding if callable(sharding) else (lambda leaf: sharding)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=pick(x)),
                      tree)


def _devices_mesh(comm: Communicator) -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(comm.devices, dtype=object), (comm.axis_name,))


def train_step(comm: Communicator, model, tx, *, batch_per_gpu: int, image_shape: tuple,
               mesh: jax.sharding.Mesh | None = None, label_smoothing: float = 0.0):
  """``(jitted step, abstract (state, images, labels))`` of `model` trained with `tx` on
  `comm` (a `lab.aot.communicator`), `batch_per_gpu` images of `image_shape` per GPU.

  `mesh`: ``xla`` only, the job's mesh (`lab.aot.mesh`); the other kinds run on
  ``comm.devices``.

  Example:
    >>> step, args = train_step(comm, model, tx, batch_per_gpu=32,  # doctest: +SKIP
    ...                         image_shape=(224, 224, 3), mesh=mesh)
    >>> compiled = compile(step, args)  # doctest: +SKIP
  """
  fn = functools.partial(_train_step, label_smoothing=label_smoothing)
  if comm.kind == "xla":
    if mesh is None:
      raise ValueError("lab.aot.train_step: the xla kind needs the job's mesh (mesh=).")
    local = mesh
    processes_batch = batch_per_gpu * mesh.size
  else:
    local = _devices_mesh(comm)
    processes_batch = batch_per_gpu * comm.local_device_count
  sample = jnp.zeros((1, *image_shape), jnp.float32)
  # The model abstractly; the optimizer's init eagerly, on zeros (shard_optimizer's init
  # probes its transformation on concrete values).
  state = jax.eval_shape(lambda: create_train_state(model, optax.identity(), sample,
                                                    jax.random.key(0)))
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state.params)
  state = state.replace(tx=tx, opt_state=jax.eval_shape(lambda: tx.init(zeros))
                        if _traceable_init(tx, zeros) else tx.init(zeros))
  images = jax.ShapeDtypeStruct((processes_batch, *image_shape), jnp.float32)
  labels = jax.ShapeDtypeStruct((processes_batch,), jnp.int32)
  replicated, split = NamedSharding(local, P()), NamedSharding(local, P(comm.axis_name))
  args = (abstract(state, replicated), abstract(images, split), abstract(labels, split))

  def recorded(f, *a):  # the recording `mnjax.data_parallel` opens around the step
    with sequence.recording():
      return f(*a)

  if comm.kind == "flat":
    args = (args[0], abstract(images, replicated), abstract(labels, replicated))
    return jax.jit(functools.partial(recorded, fn)), args
  if comm.kind == "xla":
    def per_device(state, images, labels):
      state, sums = recorded(fn, state, images, labels)
      return state, jax.tree.map(lambda x: jnp.asarray(x)[None], sums)

    out_specs = (P(), P(comm.axis_name))
  else:
    per_device = functools.partial(recorded, functools.partial(fn, axis_name=comm.axis_name))
    out_specs = P()
  mapped = jax.shard_map(per_device, mesh=local, in_specs=(P(), P(comm.axis_name),
                                                           P(comm.axis_name)),
                         out_specs=out_specs, check_vma=False)
  return jax.jit(mapped), args


def _traceable_init(tx, params) -> bool:
  """Whether ``tx.init`` can run abstractly (cheaper than on zeros for a large model)."""
  try:
    jax.eval_shape(tx.init, params)
  except jax.errors.ConcretizationTypeError:
    return False
  except (TypeError, jax.errors.TracerArrayConversionError):
    return False
  return True


def parameter_outputs(step, args) -> set[int]:
  """Positions, among the step's flattened outputs, of the updated parameters (for
  `lab.aot.schedule`).

  Example:
    >>> sorted(parameter_outputs(jax.jit(lambda s: s), ({"params": {"w": 1.0}, "n": 2},)))
    [1]
  """
  out = jax.eval_shape(step, *args)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
  return {i for i, p in enumerate(paths) if ".params" in p or "['params']" in p}


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A compiled step: its scheduled HLO, memory per device, cost and compile seconds.

  Attributes:
    text: ``compiled.as_text()`` (the scheduled GPU HLO).
    memory: ``memory_analysis()`` per device: argument, output, alias and temp bytes.
    flops: per device, from the lowered program (XLA's cost analysis on the CPU client).
    bytes_accessed: per device, of the compiled (fused) program: each kernel's operands
      and results, an estimate of the HBM traffic.
    seconds: lowering and compiling.
  """

  text: str
  memory: dict[str, int]
  flops: float
  bytes_accessed: float
  seconds: float

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs (less the aliased) + temporaries: the device memory a step needs."""
    m = self.memory
    return m["argument"] + m["output"] - m["alias"] + m["temp"]


def compile(step, args, *, global_flops: bool = False, devices: int = 1,
            compiler_options: dict | None = None) -> Compiled:
  """Lowers and compiles jitted `step` on abstract `args`; see `Compiled`.

  `global_flops`: the lowered program is the global one (plain ``jax.jit`` over a mesh,
  partitioned by XLA), so its flops are divided by `devices`; a ``shard_map`` or one-device
  program is already per device.

  Example:
    >>> c = compile(jax.jit(lambda x: x @ x), (jax.ShapeDtypeStruct((8, 8), jnp.float32),))
    >>> c.flops, c.memory["argument"]
    (1024.0, 256)
  """
  # Private JAX, the one use outside mnjax.comm._instep._compat: the deviceless executable has no
  # cost analysis ("GetCostAnalysis is not supported"), so XLA's HloCostAnalysis runs on the
  # CPU client over the lowered and the compiled module. Public replacement: none in 0.10.2.
  from jax._src import xla_bridge  # noqa: PLC0415
  from jax._src.lib import _jax  # noqa: PLC0415

  start = time.perf_counter()
  lowered = step.lower(*args)
  compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
  seconds = time.perf_counter() - start
  cpu = xla_bridge.get_backend("cpu")
  flops = _jax.hlo_module_cost_analysis(cpu, lowered._lowering.hlo().as_hlo_module())
  fused = _jax.hlo_module_cost_analysis(
      cpu, compiled._executable.xla_executable.hlo_modules()[0])
  stats = compiled.memory_analysis()
  memory = {k: int(getattr(stats, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp")}
  return Compiled(compiled.as_text(), memory,
                  float(flops.get("flops", 0.0)) / (devices if global_flops else 1),
                  float(fused.get("bytes accessed", 0.0)), seconds)
