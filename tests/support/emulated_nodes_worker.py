"""Run under ``MNJAX_EMULATE_NODES=2 mpirun -n 4``: two emulated nodes x two ranks.

Checks the node split, the device each rank drives, that each given kind averages a
gradient over every replica of both nodes, and (``flat``) the node-aware 16-bit wire; prints
one ``OK <kind> rank <r>`` line per kind.
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


def node_aware_half(comm):
  """The 16-bit wire over the emulated nodes: within `mnjax.comm.error_bound` of the float64
  mean, and the same bits on every rank."""
  within, across = comm.node_comms
  assert (within.Get_size(), across.Get_size()) == (comm.intra_size, comm.inter_size)
  n = 1001  # no count of processes divides it
  def grads(r):
    rng = np.random.default_rng(r)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
  every = np.stack([grads(r) for r in range(comm.size)]).astype(np.float64)
  for wire_dtype in (jnp.bfloat16, jnp.float16):
    got = np.asarray(jax.jit(lambda g, w=wire_dtype: collectives.allreduce_tree(
        {"g": g}, comm, wire_dtype=w)["g"])(grads(comm.rank)), np.float64)
    bound = mnjax.comm.error_bound(np.abs(every).sum(0), comm.size, wire_dtype)
    finite = np.isfinite(got)  # float16: a mean beyond 65504 is Inf
    assert np.all(np.abs(got - every.mean(0))[finite] <= bound[finite]), wire_dtype
    assert all(np.array_equal(got, other, equal_nan=True)
               for other in comm.mpi_comm.allgather(got)), "ranks differ"


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
    if kind == "flat":
      node_aware_half(comm)
    print(f"OK {kind} rank {comm.rank} node {comm.inter_rank} devices"
          f" {[d.id for d in comm.devices]}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
