"""mnjax.functions: differentiable in-step exchanges (ChainerMN's chainermn.functions).

Runs as one process and under mpirun -n 2 and -n 3 (tests/jobs/test_mpirun.py). The
two-rank chain uses ranks 0 and 1; further ranks run an empty step (the pre-flight check is
collective over the communicator). Each test compiles at most one step per rank. `JITS`:
each step is built with plain ``jax.jit`` (checked when lowered) and with
`mnjax.functions.jit` (checked when traced).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mnjax
from mnjax import functions as F

X = np.array([0.5, -1.0, 2.0], np.float32)
P = np.array([0.3, 0.7, -0.2], np.float32)
Q = np.array([1.5, -0.5, 0.25], np.float32)
EPS = 1e-2
multi_rank = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() < 2,
    reason="needs two ranks: run under mpirun -n 2 (tests/jobs/test_mpirun.py)")


def first(p, x):
  return jnp.tanh(p * x)


def second(q, h):
  return jnp.sum((q * h) ** 2) + jnp.sum(jnp.sin(h))


def idle(comm):
  """The step of a rank outside the chain (every rank must reach the pre-flight check)."""
  return F.jit(lambda: jnp.zeros(()), comm)()


def plain(fn, comm):
  del comm
  return jax.jit(fn)


JITS = pytest.mark.parametrize("jit", [plain, F.jit], ids=["jax.jit", "functions.jit"])


@multi_rank
@JITS
def test_two_rank_chain_gradient_equals_single_process(comm, jit):
  """Rank 0: f, send; rank 1: recv, g, loss. Gradients equal the single-process ones (1e-6)
  and the central differences of the distributed forward (which rank 1 sends back)."""
  like = jax.ShapeDtypeStruct((3,), jnp.float32)
  like_probes = jax.ShapeDtypeStruct((2 * 3, 3), jnp.float32)
  eye = EPS * np.eye(3, dtype=np.float32)
  probes = np.concatenate([P + eye, P - eye])  # p + eps e_i, then p - eps e_i

  def stage0(p):
    grad = jax.grad(lambda p: F.send(first(p, X), comm, 1))(p)
    F.send(first(probes, X), comm, 1)  # forward only: the losses at p +- eps e_i come back
    return grad, F.recv(comm, 1, jax.ShapeDtypeStruct((2 * 3,), jnp.float32))

  def stage1(q):
    value, grad = jax.value_and_grad(lambda q: second(q, F.recv(comm, 0, like)))(q)
    losses = jax.vmap(lambda h: second(q, h))(F.recv(comm, 0, like_probes))
    F.send(losses, comm, 0)
    return value, grad

  if comm.rank == 0:
    grad, losses = jit(stage0, comm)(P)
    want = jax.grad(lambda p: second(Q, first(p, X)))(P)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)
    central = (losses[:3] - losses[3:]) / (2 * EPS)
    np.testing.assert_allclose(grad, central, rtol=2e-2, atol=2e-3)
  elif comm.rank == 1:
    value, grad = jit(stage1, comm)(Q)
    want_value, want = jax.value_and_grad(lambda q: second(q, first(P, X)))(Q)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)
  else:
    idle(comm)


@JITS
def test_collectives_forward_and_gradient_match_numpy(comm, jit):
  """Each collective's result and the gradient of the ranks' summed losses (each rank
  differentiates its own, the backward exchanges combine them) against numpy."""
  n, r = comm.size, comm.rank
  x = {s: (np.arange(2) + 10.0 * s).astype(np.float32) for s in range(n)}  # rank s's x
  xs = {s: (np.arange(2 * n).reshape(n, 2) + 100.0 * s).astype(np.float32) for s in range(n)}
  c = {s: (s + 1.0) * (np.arange(2 * n).reshape(n, 2) + 1).astype(np.float32) for s in range(n)}
  d = {s: (s + 2.0) * np.array([1.0, -1.0], np.float32) for s in range(n)}  # row weights
  like_x = jax.ShapeDtypeStruct((2,), jnp.float32)
  like_xs = jax.ShapeDtypeStruct((n, 2), jnp.float32)

  def losses(v):
    outs = {
        "allgather": F.allgather(v["allgather"], comm),
        "alltoall": F.alltoall(v["alltoall"], comm),
        "bcast": F.bcast(v["bcast"] if r == 0 else like_x, comm, 0),
        "gather": F.gather(v["gather"], comm, 0),
        "scatter": F.scatter(v["scatter"] if r == 0 else like_xs, comm, 0),
    }
    loss = (jnp.sum(c[r] * outs["allgather"]) + jnp.sum(c[r] * outs["alltoall"])
            + jnp.sum(d[r] * outs["bcast"]) + jnp.sum(d[r] * outs["scatter"])
            + (jnp.sum(c[r] * outs["gather"]) if r == 0 else outs["gather"]))
    return loss, outs

  inputs = {"allgather": x[r], "alltoall": xs[r], "bcast": x[r], "gather": x[r],
            "scatter": xs[r]}
  grads, outs = jit(jax.grad(losses, has_aux=True), comm)(inputs)

  stacked = np.stack([x[s] for s in range(n)])
  np.testing.assert_array_equal(outs["allgather"], stacked)
  np.testing.assert_array_equal(outs["alltoall"], np.stack([xs[s][r] for s in range(n)]))
  np.testing.assert_array_equal(outs["bcast"], x[0])
  np.testing.assert_array_equal(outs["scatter"], xs[0][r])
  if r == 0:
    np.testing.assert_array_equal(outs["gather"], stacked)
  else:
    assert outs["gather"].shape == () and float(outs["gather"]) == 0.0  # the delegate
  zeros = np.zeros_like
  np.testing.assert_allclose(grads["allgather"], sum(c[s][r] for s in range(n)))
  np.testing.assert_allclose(grads["alltoall"], np.stack([c[j][r] for j in range(n)]))
  np.testing.assert_allclose(grads["bcast"], sum(d.values()) if r == 0 else zeros(x[r]))
  np.testing.assert_allclose(grads["gather"], c[0][r])
  np.testing.assert_allclose(
      grads["scatter"], np.stack([d[s] for s in range(n)]) if r == 0 else zeros(xs[r]))


@multi_rank
def test_an_allreduce_over_a_sub_communicator_pairs_in_a_checked_step(comm):
  """Data x model parallelism in one mnjax.functions.jit step over the job: rank 0 sends,
  rank 1 receives, then allreduce_gradients over a sub-communicator: rank 1 alone, the
  others together (ranks 0 and 2 under mpirun -n 3; 2 x 2 in experiments/dual_parallel.py).
  Its buckets name their ranks, so they pair instead of reading as one collective over
  every rank (rank 1 has none); the updates are the single-process replica means."""
  n, r = comm.size, comm.rank
  tx = mnjax.allreduce_gradients(comm.split(color=int(r == 1), key=r))
  like = jax.ShapeDtypeStruct((3,), jnp.float32)
  loss1 = lambda q, h: second(q[:3], h) + q[3]  # 4 parameters: a bucket of another size
  q4 = np.append(Q, np.float32(1.0))
  replica = lambda p: jnp.sum(first(p, X) ** 3)  # ranks >= 2: no exchange

  def step(p):
    if r == 0:
      grads = jax.grad(lambda p: F.send(first(p, X), comm, 1))(p)
    elif r == 1:
      grads = jax.grad(lambda q: loss1(q, F.recv(comm, 0, like)))(p)
    else:
      grads = jax.grad(replica)(p)
    return tx.update(grads, tx.init(p))[0]

  got = F.jit(step, comm)(q4 if r == 1 else P)
  if r == 1:
    want = jax.grad(lambda q: loss1(q, first(P, X)))(q4)
  else:
    g0 = jax.grad(lambda p: loss1(q4, first(p, X)))(P)
    want = (g0 + (n - 2) * jax.grad(replica)(P)) / (n - 1)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


BAD = {
    "shape": "the shapes or dtypes differ",
    "both send first": "both send first",
    "outside": "is not a rank of the communicator",
    "wrong peer": "but rank 1",
}


@multi_rank
@JITS
@pytest.mark.parametrize("case", sorted(BAD))
def test_mismatched_exchanges_raise_the_same_error_on_every_rank(comm, case, jit):
  """A send without its recv (wrong shape, a peer that sends too, a rank outside the
  communicator, a receive from another rank): the same ExchangeError on every rank,
  raised by the pre-flight check before anything is exchanged (no hang)."""
  n, r = comm.size, comm.rank
  like = jax.ShapeDtypeStruct((4,) if case == "shape" else (3,), jnp.float32)

  def step(x):
    if r == 0:
      return F.send(x, comm, n if case == "outside" else 1)
    if r == 1:
      if case == "both send first":
        return F.send(x, comm, 0) + F.recv(comm, 0, like).sum()
      if case == "wrong peer":  # rank 0 sends to rank 1, which waits for rank 2 (or none)
        return F.recv(comm, 2, like).sum() if n > 2 else jnp.zeros(())
      return F.recv(comm, 0, like).sum()
    return jnp.zeros(())

  exchanges = r == 0 or (r == 1 and (case != "wrong peer" or n > 2))
  if jit is plain and not exchanges:  # a plain jax.jit step without an exchange takes no
    jit = F.jit                       # part in the check: such a rank joins it this way
  with pytest.raises(F.ExchangeError, match=BAD[case]) as raised:
    jit(step, comm)(jnp.ones(3))
  text = comm.mpi_comm.allgather(str(raised.value).split(": ", 1)[1])  # after the caller
  assert all(t == text[0] for t in text), text  # the same message on every rank


@multi_rank
def test_an_exchange_outside_any_jitted_step_is_refused(comm):
  """Eagerly there is no step to check: every rank that calls refuses at once."""
  with pytest.raises(RuntimeError, match="outside any traced step"):
    F.send(jnp.ones(2), comm, (comm.rank + 1) % comm.size)


def ring(comm):
  return lambda x: F.send(x, comm, (comm.rank + 1) % comm.size)


@multi_rank
def test_a_plain_jax_jit_step_is_checked_before_it_runs(comm):
  """Plain jax.jit: the pairing check runs when the step is lowered (here by .lower(), the
  first call would do the same), on every rank, before anything is exchanged: a ring on
  which every rank sends first is refused; every later lowering refuses it again."""
  lowered = jax.jit(ring(comm)).trace(jnp.ones(2))  # traced: nothing checked, nothing sent
  with pytest.raises(F.ExchangeError, match="both send first") as raised:
    lowered.lower()
  with pytest.raises(F.ExchangeError, match="both send first"):
    lowered.lower()  # no second check round: the same refusal
  text = comm.mpi_comm.allgather(str(raised.value))
  assert all(t == text[0] for t in text), text


BODIES = {
    "lax.scan": lambda f, x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0],
    "lax.cond": lambda f, x: jax.lax.cond(x[0] > 0, f, lambda c: c, x),
    "lax.while_loop": lambda f, x: jax.lax.while_loop(
        lambda c: c[1] < 2, lambda c: (f(c[0]), c[1] + 1), (x, 0))[0],
}


@multi_rank
@pytest.mark.parametrize("body", sorted(BODIES))
def test_exchange_inside_a_control_flow_body_is_refused_on_every_rank(comm, body):
  """An exchange in a lax.scan, lax.cond or lax.while_loop body runs as often as the loop
  (or the branch) says, not as traced: refused on every rank (one rank's cond here), plain
  jax.jit and mnjax.functions.jit alike."""
  gather = lambda c: F.allgather(c, comm)[0]
  def step(x):
    if body == "lax.cond" and comm.rank > 0:
      return gather(x)  # the other ranks exchange at the top level
    return BODIES[body](gather, x)

  jit = F.jit if body == "lax.scan" else plain
  with pytest.raises(F.ExchangeError, match=f"inside a {body}") as raised:
    jit(step, comm)(jnp.ones(2))
  text = comm.mpi_comm.allgather(str(raised.value))
  assert all(t == text[0] for t in text), text


def test_bad_arguments_raise_at_the_call(comm):
  """Arguments every rank gets wrong alike raise at once: a `like` that is no shape, an
  exchange with itself (at size 1 every peer is), a root outside the communicator."""
  with pytest.raises(TypeError, match="like must be an array or a jax.ShapeDtypeStruct"):
    F.jit(lambda: F.recv(comm, (comm.rank + 1) % comm.size, (3,)), comm)()
  if comm.size == 1:
    with pytest.raises(F.ExchangeError, match="this rank itself"):
      F.jit(lambda x: F.send(x, comm, 0), comm)(jnp.ones(2))
    with pytest.raises(F.ExchangeError, match="root=1 is not a rank"):
      F.jit(lambda x: F.bcast(x, comm, 1), comm)(jnp.ones(2))


def test_multi_device_kinds_are_refused(comm):
  """Only 'flat' (one device per process): the other kinds say so when a function is called."""
  del comm
  hierarchical = mnjax.create_communicator("hierarchical")
  with pytest.raises(ValueError, match="kind 'flat'.*Instead: launch one process per device"):
    F.allgather(jnp.ones(2), hierarchical)
  with pytest.raises(ValueError, match="kind 'flat'"):
    F.jit(lambda x: x, hierarchical)
