"""create_multi_node_optimizer(double_buffering=True): step t applies step t - 1's gradient.

Compared with a single-process reference on the concatenated global batch (to 1e-5 after 10
steps), for ``flat``, ``two_dimensional`` and ``hierarchical`` (1 x 2 here, 2 x 2 and 3 x 2
under mpirun; ``single_node`` in one process; ``xla`` with several devices per process is
refused), with buckets and the 16-bit wire, under skip_nonfinite, inside
accumulate_gradients, and through a Checkpointer round trip and train_loop's resume (the
pending gradients flushed); the replicas stay bitwise identical.
"""

import dataclasses
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import lab.runner
import mnjax
from mnjax.checkpoint._checkpointer import CheckpointTemplateError

STEPS, PER_REPLICA, DIM = 10, 4, 5


def loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)


def init_params():
  return {"w": jnp.linspace(-1.0, 1.0, DIM * 3).reshape(DIM, 3), "b": jnp.zeros(3)}


def global_batches(replicas, steps=STEPS):
  """Every replica's examples of every step: ``(steps, replicas * PER_REPLICA, ...)``."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((steps, replicas * PER_REPLICA, DIM)).astype(np.float32)
  y = rng.standard_normal((steps, replicas * PER_REPLICA, 3)).astype(np.float32)
  return x, y


def mine(kc, batch):
  """This process's rows of a global batch (its local devices' replicas, in order)."""
  rows = PER_REPLICA * kc.local_device_count
  return batch[..., kc.rank * rows:(kc.rank + 1) * rows, :]


def make_step(kc, tx):
  """One step over this process's batch: jitted (flat) or mapped over its devices."""
  def step(params, opt_state, x, y, scale):
    grads = jax.grad(loss)(params, x, y)
    grads = jax.tree.map(lambda g: g * scale, grads)  # NaN/Inf where a test poisons it
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return mnjax.data_parallel(step, kc, batch_argnums=(2, 3))


def reference(optimizer, x, y, *, skip=(), every_k=1):
  """One process: the update of step t (cycle t) is the global-batch gradient of step t - 1
  (zero at step 0); steps whose applied gradient is listed in `skip` change nothing."""
  params, state = init_params(), optimizer.init(init_params())
  previous = jax.tree.map(jnp.zeros_like, params)
  for cycle in range(len(x) // every_k):
    micro = range(cycle * every_k, (cycle + 1) * every_k)
    grads = [jax.grad(loss)(params, x[t], y[t]) for t in micro]
    grads = jax.tree.map(lambda *g: sum(g) / every_k, *grads)
    if cycle - 1 not in skip:
      updates, state = optimizer.update(previous, state, params)
      params = optax.apply_updates(params, updates)
    previous = grads
  return params


def assert_replicas_identical(kc, tree):
  replicas = kc.mpi_comm.allgather(jax.tree.map(np.asarray, tree))
  for other in replicas[1:]:
    for a, b in zip(jax.tree.leaves(replicas[0]), jax.tree.leaves(other)):
      np.testing.assert_array_equal(a, b)


def params_before_last(kc, tx, x, y):
  return run(kc, tx, x[:-1], y[:-1])[0]


def run(kc, tx, x, y, scales=None):
  step = make_step(kc, tx)
  params = init_params()
  opt_state = tx.init(params)
  for t in range(len(x)):
    scale = 1.0 if scales is None else scales[t]
    params, opt_state = step(params, opt_state, mine(kc, x[t]), mine(kc, y[t]),
                             jnp.float32(scale))
  return params, opt_state


@functools.cache
def communicator(kind):
  return mnjax.create_communicator(kind)


CASES = [  # (kind, wire_dtype, bucket_bytes, tolerance)
    ("flat", None, None, 1e-5),
    ("flat", None, 64, 1e-5),  # several buckets, leaves reduced in place
    ("flat", jnp.bfloat16, 64, 2e-2),
    ("two_dimensional", None, None, 1e-5),
    ("two_dimensional", jnp.bfloat16, 64, 2e-2),
    ("hierarchical", None, 64, 1e-5),
] + ([("single_node", None, None, 1e-5)] if MPI.COMM_WORLD.size == 1 else [])


@pytest.mark.parametrize(("kind", "wire_dtype", "bucket_bytes", "tolerance"), CASES)
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_each_step_applies_the_previous_global_gradient(kind, wire_dtype, bucket_bytes,
                                                        tolerance):
  kc = communicator(kind)
  optimizer = optax.sgd(0.1, momentum=0.9)
  tx = mnjax.create_multi_node_optimizer(optimizer, kc, double_buffering=True,
                                         wire_dtype=wire_dtype, bucket_bytes=bucket_bytes)
  x, y = global_batches(kc.num_replicas)
  params, opt_state = run(kc, tx, x, y)
  want = reference(optimizer, x, y)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)
  assert_replicas_identical(kc, (params, opt_state.inner_state))
  # What waits is each replica's own last gradient; flushed, their sum, the same everywhere.
  flushed = mnjax.train.flush_pending(opt_state, kc)
  assert bool(flushed.exchange.reduced)
  assert jax.tree.structure(flushed) == jax.tree.structure(opt_state)
  assert_replicas_identical(kc, flushed)
  last = jax.grad(loss)(params_before_last(kc, tx, x, y), x[-1], y[-1])  # the global mean
  for a, b in zip(jax.tree.leaves(flushed.exchange.pending), jax.tree.leaves(last)):
    np.testing.assert_allclose(a / kc.num_replicas, b, rtol=tolerance, atol=tolerance)


def test_without_double_buffering_the_reference_does_not_match(comm):
  """The reference can fail: the plain exchange applies the current gradient instead."""
  optimizer = optax.sgd(0.1, momentum=0.9)
  tx = optax.chain(mnjax.allreduce_gradients(comm), optimizer)
  x, y = global_batches(comm.num_replicas)
  params, _ = run(comm, tx, x, y)
  assert not np.allclose(params["w"], reference(optimizer, x, y)["w"], atol=1e-3)


def chainermn_adamw(x, y, *, lr, weight_decay, b1=0.9, b2=0.999, eps=1e-8):
  """ChainerMN's double-buffered Adam(W), by hand in float64: step 0 only stores the global
  gradient (the actual optimizer does not run, its ``t`` stays 0); step s >= 1 runs the
  actual optimizer's update number ``t = s`` on the global gradient of step s - 1.
  Returns the parameters and the final ``t``."""
  params = {k: np.asarray(v, np.float64) for k, v in init_params().items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(p) for k, p in params.items()}
  previous, t = None, 0
  for s in range(len(x)):
    now = jax.grad(loss)({k: jnp.asarray(p, jnp.float32) for k, p in params.items()}, x[s], y[s])
    if previous is not None:
      t += 1
      for k, g in previous.items():
        m[k] = b1 * m[k] + (1 - b1) * g
        v[k] = b2 * v[k] + (1 - b2) * g * g
        direction = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
        params[k] = params[k] - lr * (direction + weight_decay * params[k])
    previous = {k: np.asarray(g, np.float64) for k, g in now.items()}
  return params, t


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_optimizer_first_runs_at_the_second_step_as_in_chainermn(kind, weight_decay):
  kc = communicator(kind)
  tx = mnjax.create_multi_node_optimizer(optax.adamw(1e-2, weight_decay=weight_decay), kc,
                                         double_buffering=True)
  x, y = global_batches(kc.num_replicas, steps=6)
  step = make_step(kc, tx)
  params, state = init_params(), tx.init(init_params())
  counts = []
  for t in range(6):
    new, state = step(params, state, mine(kc, x[t]), mine(kc, y[t]), jnp.float32(1.0))
    if t == 0:  # nothing applied, not even the weight decay
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    params = new
    counts.append(int(state.inner_state[0].count))
  assert counts == [0, 1, 2, 3, 4, 5]  # ChainerMN's t after each step
  want, t = chainermn_adamw(x, y, lr=1e-2, weight_decay=weight_decay)
  assert t == 5
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert_replicas_identical(kc, (params, state.inner_state))


def test_the_double_buffered_optimizer_resumes_bit_for_bit(comm, tmp_path):
  tx = mnjax.create_multi_node_optimizer(mnjax.skip_nonfinite(optax.adam(1e-2)), comm,
                                         double_buffering=True)
  x, y = global_batches(comm.num_replicas, steps=4)
  step = make_step(comm, tx)

  def advance(state, steps):
    params, opt = state["params"], state["opt"]
    for t in steps:
      params, opt = step(params, opt, mine(comm, x[t]), mine(comm, y[t]), jnp.float32(1.0))
    return {"params": params, "opt": opt}

  fresh = {"params": init_params(), "opt": tx.init(init_params())}
  state = advance(fresh, range(1))  # started: the first gradient waits, nothing applied yet
  state = {"params": state["params"], "opt": mnjax.train.flush_pending(state["opt"], comm)}
  with mnjax.Checkpointer(tmp_path / "ckpt", comm, async_save=False) as ckpt:
    ckpt.save(1, state)
    _, restored, _ = ckpt.restore(fresh)
  assert isinstance(restored["opt"], mnjax.optim.DoubleBufferingState)
  assert bool(restored["opt"].started) and not bool(fresh["opt"].started)
  resumed, uninterrupted = advance(restored, range(1, 4)), advance(state, range(1, 4))
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(a, b)
  assert int(resumed["opt"].inner_state.inner_state[0].count) == 3


def test_inside_accumulate_gradients_the_first_cycle_only_stores(comm):
  k = 2
  tx = mnjax.accumulate_gradients(
      mnjax.create_multi_node_optimizer(optax.adam(1e-2), comm, double_buffering=True),
      every_k=k)
  x, y = global_batches(comm.num_replicas, steps=3 * k)
  _, state = run(comm, tx, x[:k], y[:k])
  assert int(state.inner_state.inner_state[0].count) == 0 and bool(state.inner_state.started)
  _, state = run(comm, tx, x, y)
  assert int(state.inner_state.inner_state[0].count) == 2


def test_bad_arguments_and_states_are_refused(comm):
  double = functools.partial(mnjax.create_multi_node_optimizer, double_buffering=True)
  with pytest.raises(TypeError, match=r"arguments look swapped"):
    double(comm, optax.adam(1e-2))
  with pytest.raises(TypeError, match=r"GradientTransformation"):
    double("adam", comm)
  with pytest.raises(TypeError, match=r"double_buffering must be a bool"):
    mnjax.create_multi_node_optimizer(optax.adam(1e-2), comm, double_buffering=1)
  with pytest.raises(ValueError, match=r"wire_dtype must be"):
    double(optax.adam(1e-2), comm, wire_dtype=jnp.int8)
  # The chain form has no double buffering: one way, ChainerMN's.
  with pytest.raises(TypeError, match=r"double_buffering"):
    mnjax.allreduce_gradients(comm, double_buffering=True)
  # The xla kind keeps replicated state from its first local device between steps.
  xla = dataclasses.replace(comm, kind="xla", local_device_count=2)
  with pytest.raises(ValueError, match="'xla' kind needs one device per process"):
    double(optax.sgd(0.1), xla)
  tx = double(optax.adam(1e-2), comm)
  grads = {"w": jnp.ones(3)}
  with pytest.raises(TypeError, match=r"must be a DoubleBufferingState"):
    tx.update(grads, optax.adam(1e-2).init(grads), grads)
  with pytest.raises(ValueError, match=r"leaf \['w'\] is float32\[3\] in the gradient but"
                                       r" float32\[2\]"):
    jax.jit(tx.update)(grads, tx.init({"w": jnp.ones(2)}), None)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_bad_gradient_on_the_last_rank_is_skipped_one_step_later_on_every_rank(comm, bad):
  tx = mnjax.create_multi_node_optimizer(mnjax.skip_nonfinite(optax.sgd(0.1, momentum=0.9)),
                                         comm, double_buffering=True)
  x, y = global_batches(comm.num_replicas, steps=6)
  poisoned = 3
  scales = [bad if t == poisoned and comm.rank == comm.size - 1 else 1.0 for t in range(6)]
  step = make_step(comm, tx)
  params, opt_state = init_params(), tx.init(init_params())
  history = []
  for t in range(6):
    params, opt_state = step(params, opt_state, mine(comm, x[t]), mine(comm, y[t]),
                             jnp.float32(scales[t]))
    skips = opt_state.inner_state
    history.append((params, int(skips.skipped), int(skips.consecutive)))
  # Step 3 applies step 2's finite gradient; step 4 applies step 3's: skipped by every rank.
  assert [h[1:] for h in history] == [(0, 0)] * 4 + [(1, 1), (1, 0)]
  for a, b in zip(jax.tree.leaves(history[4][0]), jax.tree.leaves(history[3][0])):
    np.testing.assert_array_equal(a, b)
  assert comm.mpi_comm.allgather(history[4][1:]) == [(1, 1)] * comm.size
  want = reference(optax.sgd(0.1, momentum=0.9), x, y, skip=(poisoned,))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert_replicas_identical(comm, (params, opt_state.inner_state))


def test_inside_accumulate_gradients_each_cycle_applies_the_previous_cycle(comm):
  k = 3
  optimizer = optax.sgd(0.1, momentum=0.9)
  tx = mnjax.accumulate_gradients(
      mnjax.create_multi_node_optimizer(optimizer, comm, double_buffering=True), every_k=k)
  x, y = global_batches(comm.num_replicas, steps=4 * k)
  params, opt_state = run(comm, tx, x, y)
  want = reference(optimizer, x, y, every_k=k)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert_replicas_identical(comm, (params, opt_state.inner_state.inner_state))


def test_the_pending_gradient_survives_a_checkpoint_bit_for_bit(comm, tmp_path):
  tx = mnjax.create_multi_node_optimizer(mnjax.skip_nonfinite(optax.adam(1e-2)), comm,
                                         double_buffering=True)
  x, y = global_batches(comm.num_replicas, steps=6)
  step = make_step(comm, tx)
  state = {"params": init_params(), "opt": tx.init(init_params())}

  def advance(state, steps):
    params, opt = state["params"], state["opt"]
    for t in steps:
      params, opt = step(params, opt, mine(comm, x[t]), mine(comm, y[t]), jnp.float32(1.0))
    return {"params": params, "opt": opt}

  state = advance(state, range(3))
  assert float(jnp.abs(state["opt"].exchange.pending["w"]).sum()) > 0  # a real gradient waits
  # Each rank's own gradient waits: flushed (summed), rank 0's state is everyone's.
  state = {"params": state["params"], "opt": mnjax.train.flush_pending(state["opt"], comm)}
  assert_replicas_identical(comm, state)
  fresh = {"params": init_params(), "opt": tx.init(init_params())}
  with mnjax.Checkpointer(tmp_path / "ckpt", comm, async_save=False) as ckpt:
    ckpt.save(3, state)
    restored_step, restored, _ = ckpt.restore(fresh)
    # A run without double buffering does not silently take this state.
    plain = optax.chain(mnjax.allreduce_gradients(comm), mnjax.skip_nonfinite(optax.adam(1e-2)))
    with pytest.raises(CheckpointTemplateError):
      ckpt.restore({"params": init_params(), "opt": plain.init(init_params())})
  assert restored_step == 3
  assert isinstance(restored["opt"], mnjax.optim.DoubleBufferingState)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  # Continuing from the restored state is bitwise the uninterrupted run.
  resumed, uninterrupted = advance(restored, range(3, 6)), advance(state, range(3, 6))
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(a, b)
  assert_replicas_identical(comm, (resumed["params"], resumed["opt"].inner_state))


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_a_step_with_sync_batch_norm_runs_in_one_order_on_every_rank(comm):
  """SyncBatchNorm's collectives and the double-buffered exchange (ordered after the new
  gradient inside data_parallel): no hang, the same parameters everywhere."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = mnjax.SyncBatchNorm(comm, use_running_average=False)(nn.Dense(8)(x))
      return nn.Dense(3)(nn.relu(x))

  net = Net()
  variables = net.init(jax.random.key(0), jnp.ones((PER_REPLICA, DIM)))
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1), comm, double_buffering=True)

  def step(params, stats, opt_state, x, y):
    def objective(p):
      out, new = net.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
      return jnp.mean((out - y) ** 2), new["batch_stats"]
    grads, stats = jax.grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state

  run_step = mnjax.data_parallel(step, comm, batch_argnums=(3, 4))
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = tx.init(params)
  x, y = global_batches(comm.num_replicas, steps=3)
  for t in range(3):
    params, stats, opt_state = run_step(params, stats, opt_state, mine(comm, x[t]),
                                        mine(comm, y[t]))
  assert_replicas_identical(comm, (params, stats, opt_state.inner_state))


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
def test_an_unflushed_pending_gradient_is_refused_on_every_rank(kind, tmp_path):
  """Rank 0 writes and restore broadcasts its state: every other replica's pending gradient
  would be lost (a resumed run would leave the uninterrupted one). Refused, naming the fix;
  a fresh state (nothing pending anywhere) and a flushed one are saved."""
  kc = communicator(kind)
  if kc.num_replicas == 1:
    pytest.skip("one replica: its pending gradient is the only one (runs under mpirun)")
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1), kc, double_buffering=True)
  x, y = global_batches(kc.num_replicas, steps=1)
  fresh = {"params": init_params(), "opt": tx.init(init_params())}
  params, opt = make_step(kc, tx)(fresh["params"], fresh["opt"], mine(kc, x[0]),
                                  mine(kc, y[0]), jnp.float32(1.0))
  with mnjax.Checkpointer(tmp_path / "ckpt", kc, async_save=False) as ckpt:
    ckpt.save(0, fresh)
    with pytest.raises(ValueError, match=r"(?s)pending gradient.*not flushed.*"
                                         r"mnjax\.train\.flush_pending.*Nothing was saved"):
      ckpt.save(1, {"params": params, "opt": opt})
    assert ckpt.steps() == [0]
    ckpt.save(1, {"params": params, "opt": mnjax.train.flush_pending(opt, kc)})
    assert ckpt.steps() == [0, 1]


def test_mean_false_applies_the_previous_sum_flushed_or_not(comm):
  grads = [{"w": jnp.full(3, comm.rank + 1.0)}, {"w": jnp.full(3, 10.0 * (comm.rank + 1))}]
  total = sum(range(1, comm.size + 1))
  for mean, want in ((False, total), (True, total / comm.size)):
    tx = mnjax.create_multi_node_optimizer(optax.sgd(-1.0), comm, mean=mean,
                                           double_buffering=True)  # update = the gradient
    update = jax.jit(tx.update)
    state = tx.init(grads[0])
    out, state = update(grads[0], state, grads[0])
    np.testing.assert_array_equal(out["w"], np.zeros(3))  # step 0 applies zero
    out, after = update(grads[1], state, grads[0])
    np.testing.assert_allclose(out["w"], np.full(3, want), rtol=1e-6)
    # A flushed pending sum is applied the same way (and a second flush changes nothing).
    flushed = mnjax.train.flush_pending(mnjax.train.flush_pending(state, comm), comm)
    out_flushed, _ = update(grads[1], flushed, grads[0])
    np.testing.assert_allclose(out_flushed["w"], np.full(3, want), rtol=1e-6)
    np.testing.assert_array_equal(after.exchange.pending["w"], grads[1]["w"])


LOOP_STEPS = 3


def loop_run(comm, workdir, *, epochs, resume=False, double_buffering=True,
             shard_optimizer=False):
  """`train_loop` on the digits CNN, double-buffered through `guarded_optimizer`."""
  from lab.models import SmallCNN
  from lab.runner import RunConfig, create_train_state, guarded_optimizer, make_train_step

  digits = mnjax.data.load_digits("train")
  config = RunConfig(epochs=epochs, global_batch_size=8 * comm.size, workdir=str(workdir),
                     progress=False, resume=resume, checkpoint_steps=2,
                     double_buffering=double_buffering, shard_optimizer=shard_optimizer,
                     stall_timeout=0)
  tx = guarded_optimizer(optax.adam(1e-2), comm, config)
  state = create_train_state(SmallCNN(), tx, digits.images[:1], jax.random.key(0))
  if not shard_optimizer:  # each rank's share of a sharded state is its own: not broadcast
    state = mnjax.broadcast(state, comm)

  def batches(epoch, start):
    order = list(mnjax.epoch_batches(len(digits), comm, 8 * comm.size, shuffle=True,
                                     epoch=epoch))
    for idx, _ in order[start:LOOP_STEPS]:
      yield digits.images[idx], digits.labels[idx]

  state, _ = lab.runner.train_loop(config, comm, state, make_train_step(comm), batches,
                                    steps_per_epoch=LOOP_STEPS)
  return state


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_train_loop_resumes_a_double_buffered_run_bit_for_bit(comm, tmp_path):
  """A run stopped after step 2 of its first epoch (its epoch-end checkpoint removed, as a
  job killed there leaves it) resumes there to the uninterrupted run's bits."""
  whole = loop_run(comm, tmp_path / "whole", epochs=2)
  loop_run(comm, tmp_path / "split", epochs=1)  # checkpoints at steps 2 and 3 (epoch end)
  checkpoints = tmp_path / "split" / "checkpoints"
  if comm.rank == 0:  # the Checkpointer writes rank 0's directory
    assert sorted(d.name for d in checkpoints.iterdir() if d.name.isdigit()) == ["2", "3"]
    shutil.rmtree(checkpoints / "3")
  comm.mpi_comm.Barrier()
  resumed = loop_run(comm, tmp_path / "split", epochs=2, resume=True)
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
    np.testing.assert_array_equal(a, b)
  assert isinstance(resumed.opt_state, mnjax.optim.DoubleBufferingState)
  # The flag must match the checkpoint's, either way: refused on every rank, naming it.
  with pytest.raises(ValueError, match=r"other settings.*'double_buffering': \(True, False\)"):
    loop_run(comm, tmp_path / "split", epochs=3, resume=True, double_buffering=False)
  loop_run(comm, tmp_path / "plain", epochs=1, double_buffering=False)
  with pytest.raises(ValueError, match=r"other settings.*'double_buffering': \(False, True\)"):
    loop_run(comm, tmp_path / "plain", epochs=2, resume=True)


@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_a_resume_that_toggles_shard_optimizer_names_the_flag(comm, tmp_path):
  loop_run(comm, tmp_path / "sharded", epochs=1, double_buffering=False, shard_optimizer=True)
  with pytest.raises(ValueError, match=r"other settings.*'shard_optimizer': \(True, False\)"):
    loop_run(comm, tmp_path / "sharded", epochs=2, resume=True, double_buffering=False)


def test_the_pending_gradient_is_exchanged_without_a_copy_beside_the_step(comm):
  """The compiled step (flat, 2+ ranks) copies none of the pending gradient: its leaves go to
  MPI from the step's input (new buffers receive the sums), and each bucket's start waits for
  the previous start only, so every exchange is in flight beside the step's compute."""
  if comm.size == 1:
    pytest.skip("one process exchanges nothing")
  big = {"w": jnp.ones((256, 512)), "v": jnp.ones((512, 256)), "b": jnp.zeros(3)}
  tx = mnjax.create_multi_node_optimizer(optax.sgd(0.1, momentum=0.9), comm,
                                         double_buffering=True)

  def step(params, state, x):
    grads = jax.grad(lambda p: sum(jnp.sum(jnp.tanh(v * x)) for v in jax.tree.leaves(p)))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  text = jax.jit(step).lower(big, tx.init(big), 1.0).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  copies = [line for line in entry.splitlines() if " copy(" in line and " f32[" in line]
  assert not copies, copies
  starts = [line for line in entry.splitlines() if "mnjax_mpi_allreduce_start_linked" in line]
  assert len(starts) == 3, starts  # w, v and b, each alone in its bucket
  # Straight from the step's input, into new buffers ...
  assert all("custom-call(%state_exchange_pending" in line for line in starts), starts
  assert all("output_to_operand_aliasing" not in line for line in starts), starts
  # ... and each start after the previous start (its one-byte link), not after a done.
  names = [line.split("=")[0].strip() for line in starts]
  links = [line.split("custom-call(")[1].split(",")[1].strip(" )") for line in starts[1:]]
  picked = {}  # get-tuple-element name -> (tuple, index)
  for line in entry.splitlines():
    if "get-tuple-element(" in line:
      name, rest = line.split("=", 1)
      source = rest.split("get-tuple-element(")[1].split(")")[0]
      picked[name.strip()] = (source, rest.split("index=")[1].split(",")[0])
  assert [picked.get(link) for link in links] == [(n, "1") for n in names[:-1]], links
