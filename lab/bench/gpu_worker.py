"""The per-rank half of ``python -m lab.bench gpu``: environment, gradients, collective order.

Runs on every rank under mpirun (`lab.bench.gpu` launches it, once per group of `GROUPS`:
``xla`` starts jax.distributed, which must come before JAX uses any device and reroutes the
process's CPU collectives, so it has a launch of its own, as in `lab.bench.kinds`). Rank 0
prints one JSON line and saves each kind's averaged gradient, flattened, as
``<scratch>/<kind>.npy`` next to the float64 host reference (``reference_<group>.npy``);
the driver compares them, so every comparison (kinds against ``flat`` included) is made in
one place.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from lab.bench import hlo_order

GROUPS = {"mpi": ("flat", "hierarchical", "two_dimensional"), "xla": ("xla",)}
#: Gradient buckets of the checked steps: the digits CNN's 605 kB gradient travels in
#: several MPI calls, so their order (and the packing between them) is exercised.
BUCKET_BYTES = 64 << 10
__all__ = ["GROUPS", "run"]


def _loss(params, images, labels):
  import optax

  from lab.models import SmallCNN

  logits = SmallCNN().apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _averaged_gradient(comm, params, images, labels):
  """The gradient as `mnjax.allreduce_gradients` leaves it inside `comm`'s step."""
  import jax

  import mnjax

  tx = mnjax.allreduce_gradients(comm, bucket_bytes=BUCKET_BYTES)

  def per_device(params, images, labels):
    grads = jax.grad(_loss)(params, images, labels)
    return tx.update(grads, tx.init(params), params)[0]

  return mnjax.data_parallel(per_device, comm, batch_argnums=(1, 2))(params, images, labels)


def _host_reference(params, images, labels):
  """Mean gradient over the global batch: each example's in float32 on the host CPU,
  summed in float64 (no float32 summation-order error), flattened as `ravel_pytree`."""
  import jax
  import numpy as np

  cpu = jax.local_devices(backend="cpu")[0]
  one = lambda p, x, y: _loss(p, x[None], y[None])  # noqa: E731
  per_example = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0, 0)))(
      *jax.device_put((params, images, labels), cpu))
  rows = [np.asarray(g, np.float64).reshape(len(labels), -1) for g in jax.tree.leaves(per_example)]
  return np.concatenate(rows, axis=1).sum(0) / len(labels)


def _environment(comms: dict) -> dict:
  import jax
  import jaxlib
  import mpi4jax
  from mpi4py import MPI

  first = next(iter(comms.values()))
  mine = {"rank": first.rank, "intra_rank": first.intra_rank, "intra_size": first.intra_size,
          "devices": {kind: str(comm.devices) for kind, comm in comms.items()},
          "device_kind": first.devices[0].device_kind,
          "MPI4JAX_USE_CUDA_MPI": os.environ.get("MPI4JAX_USE_CUDA_MPI"),
          "mpi4jax_cuda_ext": bool(mpi4jax.has_cuda_support())}
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "mpi4jax": mpi4jax.__version__,
          "platform": first.devices[0].platform,
          "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
          "ranks": first.mpi_comm.allgather(mine)}


def _collective_order(comm, images, labels) -> dict:
  """The MPI custom calls of one compiled digits CNN train step, on every rank; on a CPU
  also those of the same step lowered for CUDA (optional: an error is reported, not raised)."""
  import jax
  import optax

  import mnjax
  from lab.models import SmallCNN
  from lab.runner import create_train_state, make_train_step

  tx = optax.chain(mnjax.allreduce_gradients(comm, bucket_bytes=BUCKET_BYTES), optax.adam(1e-3))
  state = create_train_state(SmallCNN(), tx, images[:1], jax.random.key(0))
  step = jax.jit(make_train_step(comm))
  compiled = step.lower(state, images, labels).compile().as_text()
  calls = [target for _, target in hlo_order.mpi_calls(compiled)]
  everyone = comm.mpi_comm.allgather(calls)
  result = {"calls": calls, "same_on_all_ranks": all(c == calls for c in everyone),
            "unchained_pairs": len(hlo_order.unchained_compiled(compiled))}
  if comm.devices[0].platform != "cpu":
    result["cuda_lowered"] = "not needed: the compiled step above is this GPU's"
    return result
  try:
    text = step.trace(state, images, labels).lower(lowering_platforms=("cuda",)).as_text()
    result["cuda_lowered"] = [target for _, target in hlo_order.mpi_calls(text)]
    result["cuda_unchained_pairs"] = len(hlo_order.unchained(text))
  except Exception as error:  # noqa: BLE001 (optional: JAX may refuse an absent platform)
    result["cuda_lowered"] = f"error: {type(error).__name__}: {str(error)[:300]}"
  return result


def run(group: str, global_batch: int, scratch: str) -> dict | None:
  """Runs the group's checks on this rank; rank 0 returns the results, the others None.

  Args:
    group: a key of `GROUPS`.
    global_batch: examples over all ranks (digits train split); must split evenly over
      every replica.
    scratch: the folder where rank 0 saves the gradients for the driver.

  Example:
    >>> run("mpi", 64, scratch)["gradients"]["flat"]["identical_on_all_ranks"]  # doctest: +SKIP
    True
  """
  import mnjax

  comms = {}
  if group == "xla":  # first: jax.distributed must start before JAX uses any device
    comms["xla"] = mnjax.create_communicator("xla")
  import jax
  import numpy as np
  from jax.flatten_util import ravel_pytree

  from lab.models import SmallCNN

  # Full float32 convolutions and matmuls on every platform (no TF32 on GPUs), so that the
  # kinds differ from the reference only by float32 summation order.
  jax.config.update("jax_default_matmul_precision", "highest")
  for kind in GROUPS[group]:
    if kind not in comms:
      comms[kind] = mnjax.create_communicator(kind, share_devices=True)
  first = comms[GROUPS[group][0]]
  data = mnjax.data.load_digits("train")
  if global_batch % first.num_replicas or global_batch > len(data):
    raise ValueError(f"lab.bench gpu: global batch {global_batch} must be at most"
                     f" {len(data)} and split over {first.num_replicas} replicas.")
  images, labels = data.images[:global_batch], data.labels[:global_batch]
  per_process = global_batch // first.size
  mine = slice(first.rank * per_process, (first.rank + 1) * per_process)
  params = SmallCNN().init(jax.random.key(0), images[:1])["params"]
  out = Path(scratch)
  result = {"environment": _environment(comms), "gradients": {}, "collective_order": {}}
  reference = _host_reference(params, images, labels)
  if first.is_root:
    np.save(out / f"reference_{group}.npy", reference)
  for kind, comm in comms.items():
    start = time.perf_counter()
    grads = jax.block_until_ready(_averaged_gradient(comm, params, images[mine], labels[mine]))
    vector = np.asarray(ravel_pytree(grads)[0], np.float32)
    digests = comm.mpi_comm.allgather(hashlib.sha256(vector.tobytes()).hexdigest())
    if comm.is_root:
      np.save(out / f"{kind}.npy", vector)
    result["gradients"][kind] = {
        "processes": comm.size, "local_devices": comm.local_device_count,
        "replicas": comm.num_replicas, "identical_on_all_ranks": len(set(digests)) == 1,
        "seconds": time.perf_counter() - start}
    if kind != "xla":  # no MPI custom calls: XLA's own collectives
      result["collective_order"][kind] = _collective_order(comm, images[mine], labels[mine])
  return result if first.is_root else None
