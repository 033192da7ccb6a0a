"""Run under mpirun by tests/jobs/test_xla.py: the `xla` kind in a fresh process.

`create_communicator("xla")` must come before JAX touches a device, so this cannot live in
the shared pytest process. Prints one ``XLA OK`` line per rank when every check passes.
"""

import mnjax

comm = mnjax.create_communicator("xla")

import hashlib

import jax
import numpy as np
import optax

from lab.models import SmallCNN
from lab.runner import create_train_state, make_train_step
from mnjax.comm._instep import _allreduce as collectives

PER_DEVICE = 4
data = mnjax.data.load_digits("train")
model = SmallCNN()
assert comm.num_replicas == jax.device_count() == comm.size * jax.local_device_count()

# 1. Averaged gradients equal the global-batch gradient (what flat computes), fp32 rounding.
global_batch = PER_DEVICE * comm.num_replicas
images, labels = data.images[:global_batch], data.labels[:global_batch]
params = model.init(jax.random.key(0), images[:1])["params"]


def loss(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()


averaged = mnjax.data_parallel(
    lambda p, x, y: collectives.allreduce_tree(jax.grad(loss)(p, x, y), comm), comm,
    batch_argnums=(1, 2),
)
per_process = global_batch // comm.size
mine = slice(comm.rank * per_process, (comm.rank + 1) * per_process)
got = averaged(params, images[mine], labels[mine])
expected = jax.jit(jax.grad(loss))(params, images, labels)
worst = max(
    float(np.linalg.norm(a - b) / np.linalg.norm(b))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))
)
assert worst <= 1e-5, worst

# 2. Training keeps parameters identical on every process.
tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-3))
state = mnjax.broadcast(
    create_train_state(model, tx, images[:1], jax.random.key(comm.rank)), comm
)
step = make_train_step(comm)
for idx, _ in mnjax.epoch_batches(len(data), comm, 8 * comm.num_replicas, shuffle=True):
  state, metrics = step(state, data.images[idx], data.labels[idx])
  if int(state.step) == 4:
    break
digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(state.params)))
assert len(set(comm.mpi_comm.allgather(digest.hexdigest()))) == 1
assert int(metrics["count"]) == 8 * comm.local_device_count
# 3. Per-device state cannot survive a step here (replicated outputs come back from the
# first local device): accumulate_gradients refuses it, on every rank, before any exchange.
if comm.local_device_count > 1:
  acc = mnjax.accumulate_gradients(optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)),
                                   every_k=2)
  try:
    mnjax.data_parallel(lambda p, s, x, y: acc.update(jax.grad(loss)(p, x, y), s, p), comm,
                        batch_argnums=(2, 3))(params, acc.init(params), images[mine],
                                                 labels[mine])
  except ValueError as error:
    assert "keeps only the first device's copy" in str(error), error
  else:
    raise AssertionError("accumulate_gradients ran under xla with several local devices")
# 4. replica_index: this process's devices hold replicas rank * local + i, the order in
# which the batch is dealt (lax.axis_index over the job's mesh).
index = mnjax.data_parallel(lambda: (mnjax.train.replica_index(comm),), comm, batch_argnums=(),
                            per_device_outputs=(0,))()[0]
n = comm.local_device_count
assert index.tolist() == [comm.rank * n + i for i in range(n)], index
print(f"XLA OK rank {comm.rank} worst relative difference {worst:.2e}", flush=True)
