"""ChainerMN's "dual parallel" on 4 ranks: 2 model-parallel stages x 2 data-parallel replicas.

``mpirun -n 4 python tests/support/dual_parallel_worker.py DIR`` with ``MNJAX_EMULATE_NODES=2``.
As ChainerMN's dual-parallel MNIST: ``data_comm = comm.split(rank % 2, rank)`` (the ranks
holding one stage), ``model_comm = comm.split(rank // 2, rank)`` (one replica's two stages).
Stage 0 sends its activations to stage 1 over ``model_comm`` (host send/recv) and gets their
gradient back; each stage averages its gradients over ``data_comm`` only
(`mnjax.allreduce_gradients` inside `mnjax.data_parallel`, whose program check compares the
group's ranks: the two stages run different programs). After 3 steps every rank's stage equals
the same stage of the whole model trained in one process on the global batch; the stage is
checkpointed per group and restored. Prints ``OK rank R ...`` per rank; then rank 2 waits
to receive from rank 3, which has finished: an error naming it, not a hang.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mnjax

STEPS, BATCH, LR = 3, 8, 0.5


def stage0(w, x):
  return jnp.tanh(x @ w)


def stage1(w, h, y):
  logits = h @ w
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(directory: str) -> None:
  comm = mnjax.create_communicator("flat")
  assert comm.size == 4, "run with mpirun -n 4"
  data_comm = comm.split(comm.rank % 2, comm.rank)
  model_comm = comm.split(comm.rank // 2, comm.rank)
  stage, replica = model_comm.rank, data_comm.rank
  assert (data_comm.size, model_comm.size) == (2, 2)
  # Emulated nodes {0, 1}, {2, 3}: a stage's replicas on two nodes, a replica on one.
  assert (data_comm.inter_size, data_comm.intra_size) == (2, 1)
  assert (model_comm.inter_size, model_comm.intra_size) == (1, 2)

  rng = np.random.default_rng(0)
  x_all = rng.normal(size=(BATCH, 4)).astype(np.float32)
  y_all = rng.integers(0, 3, size=BATCH)
  w_all = [jax.random.normal(jax.random.key(1), (4, 5)),
           jax.random.normal(jax.random.key(2), (5, 3))]
  rows = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
  x, y = x_all[rows], y_all[rows]

  tx = optax.chain(mnjax.allreduce_gradients(data_comm), optax.sgd(LR, momentum=0.9))
  update = mnjax.data_parallel(
      lambda w, s, g: (lambda u, s: (optax.apply_updates(w, u), s))(*tx.update(g, s, w)),
      data_comm, batch_argnums=())
  w = w_all[stage]
  opt = tx.init(w)
  forward = jax.jit(stage0)
  backward0 = jax.jit(lambda w, x, g: jax.vjp(lambda w: stage0(w, x), w)[1](g)[0])
  grad1 = jax.jit(jax.grad(stage1, argnums=(0, 1)))
  with mnjax.Watchdog(data_comm, timeout=120) as watchdog:
    for step in range(STEPS):
      watchdog.step(step)
      if stage == 0:
        model_comm.send(forward(w, x), dest=1, tag=step)
        grad = backward0(w, x, model_comm.recv(source=1, tag=step))
      else:
        grad, grad_h = grad1(w, model_comm.recv(source=0, tag=step), y)
        model_comm.send(grad_h, dest=0, tag=step)
      w, opt = update(w, opt, grad)

  # The whole model, one process, the global batch: the same optimizer without allreduce.
  ref_tx = optax.sgd(LR, momentum=0.9)
  params, ref_opt = list(w_all), ref_tx.init(list(w_all))

  def loss(p):
    return stage1(p[1], stage0(p[0], x_all), y_all)

  for _ in range(STEPS):
    updates, ref_opt = ref_tx.update(jax.grad(loss)(params), ref_opt, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(w, params[stage], rtol=1e-5, atol=1e-6)

  mnjax.check_replicas({"w": w}, data_comm)  # a stage's replicas agree (the stages differ)
  ckpt = mnjax.Checkpointer(f"{directory}/stage{stage}", data_comm, async_save=False)
  ckpt.save(STEPS, {"w": w})
  step, restored, _ = ckpt.restore({"w": jnp.zeros_like(w)})
  ckpt.close()
  assert step == STEPS and np.array_equal(restored["w"], w)
  print(f"OK rank {comm.rank} stage {stage} replica {replica}", flush=True)
  if comm.rank == 2:  # its peer in model_comm, rank 3, now exits: named, not waited for
    try:
      model_comm.recv_obj(source=1)
    except RuntimeError as error:
      assert "rank 1 finished its program" in str(error), error
      print("OK a receive from a peer that finished is an error", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
