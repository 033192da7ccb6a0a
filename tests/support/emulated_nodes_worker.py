"""Run under ``MNJAX_EMULATE_NODES=2 mpirun -n 4``: two emulated nodes x two ranks.

Checks the node split, the device each rank drives, and that each given kind averages a
gradient over every replica of both nodes; prints one ``OK <kind> rank <r>`` line per kind.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import mnjax
from mnjax.comm._instep import _allreduce as collectives


def averaged(comm):
  """Each replica contributes its global index; the mean is (replicas - 1) / 2."""
  n = comm.local_device_count
  first = comm.rank * n
  rows = jnp.arange(first, first + n, dtype=jnp.float32)[:, None] * jnp.ones((1, 5))
  step = mnjax.data_parallel(lambda x: collectives.allreduce_tree({"g": x[0]}, comm)["g"],
                             comm, batch_argnums=(0,))
  return np.asarray(step(rows))


def main(kinds):
  for kind in kinds:
    comm = mnjax.create_communicator(kind)
    per_node = comm.size // 2
    assert (comm.intra_rank, comm.intra_size) == (comm.rank % per_node, per_node), comm
    assert (comm.inter_rank, comm.inter_size) == (comm.rank // per_node, 2), comm
    local = jax.local_devices()
    if kind == "flat":
      assert comm.devices == (local[comm.intra_rank % len(local)],), comm.devices
      out = jax.jit(lambda x: x + 1)(jnp.zeros(3))  # a plain jit runs on the rank's device
      assert out.devices() == set(comm.devices), (out.devices(), comm.devices)
    else:
      assert comm.devices == tuple(local), comm.devices
    got = averaged(comm)
    want = (comm.num_replicas - 1) / 2
    np.testing.assert_allclose(got, np.full(5, want), rtol=1e-6)
    print(f"OK {kind} rank {comm.rank} node {comm.inter_rank} devices"
          f" {[d.id for d in comm.devices]}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
