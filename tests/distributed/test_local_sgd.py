"""local_sgd: each replica steps on its own gradient and the replicas meet every k steps
(plain averaging and DiLoCo's outer Nesterov step, as a NumPy reference computes them, on a
16-bit wire too) on an anchor with the same bits everywhere, which each replica's parameters
equal but in the elements it counts as inexact; one exchange per round on the wire; the state
checkpointed per rank and resumed bitwise; bad arguments refused when built.

Runs as one process and under mpirun -n 2 and -n 3 (tests/jobs/test_mpirun.py).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _recorder as recorder

SHAPES = {"b": (5,), "w": (7, 3)}


def gradient(rank, step):
  """Replica `rank`'s gradient at `step`: its own, different on every replica and step."""
  rng = np.random.default_rng(1000 * rank + step)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def initial():
  return {"b": np.zeros(5, np.float32),  # starts at zero and crosses it on some replicas
          "w": np.random.default_rng(7).standard_normal((7, 3)).astype(np.float32)}


def train(comm, tx, steps, params=None, state=None, first=0):
  """Runs `steps` steps of `tx` on this rank's gradients; returns params, state and the
  params after every step."""
  params = jax.tree.map(jnp.asarray, initial() if params is None else params)
  state = tx.init(params) if state is None else state
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  seen = []
  for i in range(first, first + steps):
    updates, state = step(gradient(comm.rank, i), state, params)
    params = optax.apply_updates(params, updates)
    seen.append((jax.tree.map(np.asarray, params), state))
  return params, state, seen


def reference(size, every_k, steps, lr, outer=None):
  """Local SGD with plain SGD inside, in NumPy float64: each replica's params after every step
  (rows of the outer list are steps)."""
  replicas = [jax.tree.map(np.float64, initial()) for _ in range(size)]
  anchor = jax.tree.map(np.float64, initial())
  velocity = jax.tree.map(np.zeros_like, anchor)
  outer_lr, m = outer if outer is not None else (0.0, 0.0)
  out = []
  for i in range(steps):
    replicas = [jax.tree.map(lambda p, g: p - lr * g, p, gradient(r, i))
                for r, p in enumerate(replicas)]
    if (i + 1) % every_k == 0:
      change = jax.tree.map(lambda a, *ps: a - sum(ps) / size, anchor, *replicas)
      if outer is None:
        anchor = jax.tree.map(lambda a, c: a - c, anchor, change)
      else:  # optax.sgd(lr, momentum=m, nesterov=True)
        velocity = jax.tree.map(lambda v, c: c + m * v, velocity, change)
        anchor = jax.tree.map(lambda a, v, c: a - outer_lr * (c + m * v), anchor, velocity, change)
      replicas = [anchor for _ in range(size)]
    out.append(replicas)
  return out


def everywhere(comm, tree):
  return comm.mpi_comm.allgather(jax.tree.map(np.asarray, tree))


def assert_same_on_every_rank(comm, tree):
  for other in everywhere(comm, tree):
    jax.tree.map(np.testing.assert_array_equal, other, jax.tree.map(np.asarray, tree))


def assert_met(comm, params, state):
  """After a meeting: the anchor has the same bits on every rank, and these params equal it
  but in `inexact` elements, each within two units in the last place of the leaf's largest."""
  assert_same_on_every_rank(comm, state.anchor)
  differ = 0
  for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(state.anchor)):
    p, a = np.asarray(p), np.asarray(a)
    differ += int(np.sum(p != a))
    np.testing.assert_allclose(p, a, rtol=0, atol=2.0 ** -22 * np.max(np.abs(a) + np.abs(p)))
  assert differ == int(state.inexact)


@pytest.mark.parametrize("outer", [None, (0.7, 0.9)], ids=["averaging", "diloco"])
def test_replicas_meet_on_the_same_bits_every_k_steps(comm, outer):
  every_k, steps, lr = 3, 7, 0.1
  outer_tx = None if outer is None else optax.sgd(outer[0], momentum=outer[1], nesterov=True)
  tx = mnjax.optim.local_sgd(optax.sgd(lr), comm, every_k=every_k, outer=outer_tx)
  _, state, seen = train(comm, tx, steps)
  want = reference(comm.size, every_k, steps, lr, outer)
  for i, (params, after) in enumerate(seen):
    mine = want[i][comm.rank]
    jax.tree.map(lambda got, w: np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-6),
                 params, mine)
    if (i + 1) % every_k == 0:
      assert_met(comm, params, after)
    elif comm.size > 1:  # between meetings each replica has moved on its own gradient
      assert not np.array_equal(*[p["w"] for p in everywhere(comm, params)[:2]])
  assert int(state.steps_left) == every_k - steps % every_k
  jax.tree.map(np.testing.assert_array_equal, state.anchor, seen[5][1].anchor)


def test_an_outer_sgd_of_rate_one_is_plain_averaging_bit_for_bit(comm):
  plain = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=2)
  outer = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=2, outer=optax.sgd(1.0))
  a, _, _ = train(comm, plain, 4)
  b, _, _ = train(comm, outer, 4)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_sixteen_bit_wire_meets_on_the_same_bits_close_to_float32(comm):
  full = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=2)
  half = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=2, wire_dtype=jnp.bfloat16)
  a, _, _ = train(comm, full, 4)
  b, state, _ = train(comm, half, 4)
  assert_met(comm, b, state)
  # bfloat16 rounds each replica's change since the last meeting (|change| <= 0.5 here)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2 * 0.5 * 2.0 ** -8), a, b)


def test_meet_next_step_ends_the_round_early(comm):
  tx = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=5)
  params, state, _ = train(comm, tx, 2)
  params, state, seen = train(comm, tx, 1, params, mnjax.optim.meet_next_step(state), first=2)
  assert int(state.steps_left) == 5
  assert_met(comm, params, state)


def test_one_exchange_per_round_on_the_wire(comm, tmp_path):
  """The timeline's executed collectives: local_sgd moves 1/k of allreduce_gradients' bytes
  (plus one float per leaf at each meeting)."""
  every_k, steps = 4, 8
  path = comm.mpi_comm.bcast(str(tmp_path / "trace.json"), root=0)
  txs = {"sync": optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1)),
         "local": mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=every_k)}
  n = jnp.int32(0)
  with mnjax.guard.Timeline(comm, path, verbose=False) as timeline:
    for tx in txs.values():
      def step(n, params, state, grads, tx=tx):
        n = recorder.mark_step(n)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return recorder.mark_step(n + 1, end=True, after=recorder.completion(params)), params, state
      step = jax.jit(step)
      params = jax.tree.map(jnp.asarray, initial())
      state = tx.init(params)
      for i in range(steps):
        timeline.step(int(n))
        n, params, state = step(n, params, state, gradient(comm.rank, i))
        jax.block_until_ready(n)
  trace = comm.mpi_comm.bcast(json.load(open(path)) if comm.rank == 0 else None, root=0)
  sent = {}
  for e in trace["traceEvents"]:
    if e.get("cat") == "collective" and not e["args"]["host"] and e["pid"] == comm.rank:
      name = "sync" if e["args"]["step"] < steps else "local"
      sent.setdefault(name, []).append((e["args"]["step"], e["args"]["wire_bytes"]))
  if comm.size == 1:  # nothing crosses processes
    assert sent == {}
    return
  params_bytes = sum(4 * int(np.prod(s)) for s in SHAPES.values())
  assert sum(b for _, b in sent["sync"]) >= steps * params_bytes
  local_steps = sorted({s - steps for s, _ in sent["local"]})
  assert local_steps == [every_k - 1, 2 * every_k - 1]  # the meeting steps only
  local = sum(b for _, b in sent["local"])
  assert local <= (steps // every_k) * (params_bytes + 4 * len(SHAPES))
  assert local <= sum(b for _, b in sent["sync"]) / every_k + 4 * len(SHAPES) * 2


def test_the_inner_state_is_checkpointed_per_rank_and_resumes_bitwise(comm, tmp_path):
  # Saved right after the meeting of step 4 with params = the anchor, as lab.runner does: a
  # replica's own params may miss the anchor in an element that crossed zero (counted in
  # `inexact`), so only the anchor is the same on every replica whatever the trajectory.
  tx = mnjax.optim.local_sgd(optax.adam(0.05), comm, every_k=2)
  _, state, _ = train(comm, tx, 4)
  _, _, whole = train(comm, tx, 2, state.anchor, state, first=4)
  directory = comm.mpi_comm.bcast(str(tmp_path / "ckpt"), root=0)
  with mnjax.Checkpointer(directory, comm, async_save=False) as ckpt:
    ckpt.save(4, {"params": state.anchor, "opt": state})
    fresh = jax.tree.map(jnp.asarray, initial())
    step, back, _ = ckpt.restore({"params": fresh, "opt": tx.init(fresh)})
  assert step == 4 and isinstance(back["opt"], mnjax.optim.LocalSGDState)
  jax.tree.map(np.testing.assert_array_equal, back["opt"].inner_state, state.inner_state)
  _, _, rest = train(comm, tx, 2, back["params"], back["opt"], first=4)
  jax.tree.map(np.testing.assert_array_equal, rest[-1][0], whole[-1][0])


def test_a_save_between_meetings_names_the_fix(comm, tmp_path):
  if comm.size == 1:
    pytest.skip("replicas that differ need two ranks (runs under mpirun)")
  tx = mnjax.optim.local_sgd(optax.sgd(0.1), comm, every_k=2)
  params, state, _ = train(comm, tx, 1)
  directory = comm.mpi_comm.bcast(str(tmp_path / "ckpt"), root=0)
  with mnjax.Checkpointer(directory, comm, async_save=False) as ckpt:
    with pytest.raises(ValueError, match="between meetings.*meet_next_step"):
      ckpt.save(1, {"params": params, "opt": state})


def test_bad_arguments_are_refused_when_built(comm):
  sgd = optax.sgd(0.1)
  for every_k in (0, 1.5, True, "8"):
    with pytest.raises(ValueError, match="every_k must be an int >= 1"):
      mnjax.optim.local_sgd(sgd, comm, every_k=every_k)
  with pytest.raises(TypeError, match="outer must be an optax GradientTransformation"):
    mnjax.optim.local_sgd(sgd, comm, every_k=2, outer=0.7)
  with pytest.raises(TypeError, match="arguments look swapped|the order is local_sgd"):
    mnjax.optim.local_sgd(comm, sgd, every_k=2)
  params = {"w": jnp.ones(4)}
  sharded = mnjax.optim.local_sgd(mnjax.shard_optimizer(sgd, comm), comm, every_k=2)
  with pytest.raises(ValueError, match="exchanges gradients every step itself"):
    sharded.init(params)
  chained = mnjax.optim.local_sgd(optax.chain(mnjax.allreduce_gradients(comm), sgd), comm,
                                  every_k=2)
  with pytest.raises(ValueError, match="inside local_sgd"):
    jax.jit(chained.update)(params, chained.init(params), params)
  with pytest.raises(ValueError, match="needs params"):
    jax.jit(lambda g, s: mnjax.optim.local_sgd(sgd, comm, every_k=2).update(g, s))(
        params, mnjax.optim.local_sgd(sgd, comm, every_k=2).init(params))
