"""mnjax.functions: differentiable in-step exchanges (ChainerMN's chainermn.functions).

Runs as one process and under mpirun -n 2 and -n 3 (tests/jobs/test_mpirun.py). The
two-rank chain uses ranks 0 and 1; further ranks run an empty step (the pre-flight check is
collective over the communicator). Each test compiles at most a few small steps per rank.
`JITS`: each step is built with plain ``jax.jit`` (checked when lowered) and with
`mnjax.functions.jit` (checked when traced). The refusals of where an exchange may be
called (`gathered`) run at every size, one process included.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core
from mpi4py import MPI

import mnjax
from mnjax import functions as F
from mnjax.functions import _chain, _collective
from mnjax.guard import _preflight as preflight

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



def test_sync_batch_norm_over_a_sub_communicator_pairs_in_a_checked_step(comm):
  """SyncBatchNorm over a group beside an exchange, in one mnjax.functions.jit step over the
  job: rank 0 sends to rank 1, and every rank but 1 normalises over its group. The layer's
  entry names its ranks, so it pairs instead of reading as one collective over every rank
  (rank 1 has none); its mean is the group's."""
  if comm.size < 3:
    pytest.skip("a group of two or more beside a third rank: runs under mpirun -n 3")
  r = comm.rank
  sub = comm.split(color=int(r == 1), key=r)
  norm = mnjax.SyncBatchNorm(sub, use_running_average=False, momentum=0.0)
  x = jnp.full((2, 3), float(r))
  variables = norm.init(jax.random.key(0), x)
  like = jax.ShapeDtypeStruct((3,), jnp.float32)

  def step(batch):
    if r == 1:
      return F.recv(comm, 0, like)
    sent = F.send(first(P, X), comm, 1) if r == 0 else jnp.zeros(())
    _, new = norm.apply(variables, batch, mutable=["batch_stats"])
    return new["batch_stats"]["mean"] + 0.0 * sent

  got = F.jit(step, comm)(x)
  want = first(P, X) if r == 1 else np.full(3, np.mean([q for q in range(comm.size) if q != 1]))
  np.testing.assert_allclose(got, want, rtol=1e-6)

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
  with pytest.raises(RuntimeError, match=r"mnjax.functions \(a refused call\): called outside"):
    F.send(jnp.ones(2), comm, comm.size)  # a refused call's stand-in, evaluated eagerly


def gathered(comm):
  """A fresh ``x -> F.allgather(x, comm)[0]`` (a new function: JAX caches no trace of it).

  At size 1, where `F.allgather` returns ``x[None]`` without exchanging, the same path the
  other sizes take (`mnjax.functions._chain.apply`: its refusals, the ``custom_vjp``, a
  size-1 MPI allgather, the step's check), so a refusal is raised in one process too.
  """
  if comm.size > 1:
    return lambda x: F.allgather(x, comm)[0]
  forward = functools.partial(_collective._allgather, comm, "mnjax.functions.allgather")
  backward = functools.partial(_collective._allgather_backward, comm)
  return lambda x: _chain.apply(forward, backward, x, x.dtype, comm, "allgather")[0]


def same_on_every_rank(comm, error):
  """Every rank raised, the same text (a rank that did not would leave the others waiting
  here: mpirun's timeout makes that a failure)."""
  text = comm.mpi_comm.allgather(str(error))
  assert all(t == text[0] for t in text), text


EAGER = {
    "eagerly": lambda f, x: f(x),
    "under an eager jax.grad": lambda f, x: jax.grad(lambda x: f(x).sum())(x),
    "under an eager jax.vmap": lambda f, x: jax.vmap(f)(jnp.stack([x, x])),
    "from a jaxpr run eagerly": lambda f, x: jax_core.jaxpr_as_fun(jax.make_jaxpr(f)(x))(x),
}


@pytest.mark.parametrize("how", sorted(EAGER))
def test_an_exchange_under_an_eager_transformation_is_refused(comm, how):
  """Outside any jax.jit, also under an eager jax.grad or jax.vmap (JAX computes as it
  goes: no step to check) or from a traced jaxpr evaluated eagerly, every rank raises at
  once with the fix (not JAX's "Batching rule ..." or "Evaluation rule ... not
  implemented")."""
  with pytest.raises(RuntimeError, match="outside any traced step.*inside jax.jit") as raised:
    EAGER[how](gathered(comm), jnp.ones(2))
  same_on_every_rank(comm, raised.value)


@JITS
def test_an_exchange_inside_an_inner_jit_is_refused_on_every_rank(comm, jit):
  """An exchange in a jitted function called from the jitted step (rank 0's; the others
  exchange at the step's top level): JAX would reuse that function's cached trace in later
  steps without tracing the exchange again, so refused on every rank when traced."""
  gather = gathered(comm)
  def step(x):
    return jax.jit(gather)(x) if comm.rank == 0 else gather(x)

  with pytest.raises(F.ExchangeError, match="called inside an inner jax.jit") as raised:
    jit(step, comm)(jnp.ones(2))
  same_on_every_rank(comm, raised.value)


@JITS
def test_a_cached_inner_jit_is_refused_too(comm, jit):
  """The inner jax.jit's trace made before the step (by a call of its own, on every rank):
  JAX reuses it inside the step without tracing the exchange again, so the refusal comes
  when the step is lowered, where the exchange sits in a function the step calls."""
  inner = jax.jit(gathered(comm))
  inner(jnp.ones(2))  # a step of its own: checked, and run on every rank
  with pytest.raises(F.ExchangeError, match="called inside an inner jax.jit") as raised:
    jit(lambda x: inner(x) + 1, comm)(jnp.ones(2))
  same_on_every_rank(comm, raised.value)


@multi_rank
@JITS
def test_a_cached_inner_jit_on_one_rank_is_refused_on_every_rank(comm, jit):
  """Rank 0 cached the inner function's trace by a call of its own (the others ran another
  function with the same exchange); in the step, rank 0's exchange comes back untraced and
  the others trace it afresh: every rank raises, naming the inner jax.jit."""
  inner = jax.jit(gathered(comm))
  if comm.rank == 0:
    inner(jnp.ones(2))
  else:
    jax.jit(gathered(comm))(jnp.ones(2))
  with pytest.raises(F.ExchangeError, match="called inside an inner jax.jit"):
    jit(lambda x: inner(x) + 1, comm)(jnp.ones(2))


DIFFERENTIATED = {
    "jax.grad(jax.jit(f))": (
        lambda f: jax.grad(jax.jit(f)),
        r"differentiated from outside its jitted step.*: jax\.jit\(jax\.grad\(f\)\)"),
    "jax.jit(jax.grad(jax.jit(f)))": (
        lambda f: jax.jit(jax.grad(jax.jit(f))),
        r"called inside an inner jax\.jit.*drop the inner jax\.jit"),
}


@pytest.mark.parametrize("how", sorted(DIFFERENTIATED))
def test_a_jitted_step_differentiated_from_outside_is_refused_on_every_rank(comm, how):
  """jax.grad of a jitted step traces each exchange's forward again, in a trace of its own
  outside the step's check (the ranks' checks would not line up): refused on every rank,
  with the fix (jax.jit(jax.grad(f)))."""
  transform, message = DIFFERENTIATED[how]
  gather = gathered(comm)
  with pytest.raises(F.ExchangeError, match=message) as raised:
    transform(lambda x: gather(x).sum())(jnp.ones(2))
  same_on_every_rank(comm, raised.value)


def rounds(monkeypatch, error=None):
  """The pre-flight check's rounds from now on (one entry each: its host allgather, or at
  size 1 its pairing), each raising `error` instead when given."""
  opened = []
  def counted(real):
    def round_(*args, **kwargs):
      opened.append(real.__name__)
      if error is not None:
        raise error
      return real(*args, **kwargs)
    return round_
  monkeypatch.setattr(preflight, "gather_if_different", counted(preflight.gather_if_different))
  monkeypatch.setattr(preflight.pairing, "check_exchanges",
                      counted(preflight.pairing.check_exchanges))
  return opened


def test_a_retrace_with_an_agreed_sequence_opens_no_new_round(comm, monkeypatch):
  """Under plain jax.jit, a retrace of a step (another static argument) whose exchanges the
  ranks agreed on is not checked again (one rank could retrace alone); another step with
  the same exchanges is (its own agreement)."""
  opened = rounds(monkeypatch)
  x = jnp.ones(2)
  gather = gathered(comm)
  step = jax.jit(lambda x, k: gather(x) * k, static_argnums=1)
  step(x, 1)
  assert len(opened) == 1, opened
  np.testing.assert_array_equal(step(x, 2), 2 * x)  # retraced: the same sequence
  assert len(opened) == 1, opened
  other = jax.jit(lambda x, k: gather(x) * k, static_argnums=1)
  other(x, 1)
  assert len(opened) == 2, opened
  made = [jax.jit(lambda x, k=k: gather(x) * k) for k in (1, 2)]  # one line: two functions
  for n, made_step in enumerate(made):
    made_step(x)
    assert len(opened) == 3 + n, opened


@multi_rank
def test_two_steps_of_one_factory_are_checked_each_on_its_own(comm):
  """Under plain jax.jit, two closures of one factory (one source location) are two steps:
  the second is checked although rank 0's sequence equals the first's, so the other ranks'
  different one is an error on every rank, not a round they would wait in alone."""
  gather = gathered(comm)
  def make(n):
    return jax.jit(lambda x: gather(jnp.tile(x, 1 if comm.rank == 0 else n)))
  first, second = make(1), make(2)
  first(jnp.ones(2))
  with pytest.raises(F.ExchangeError, match="rank 1") as raised:
    second(jnp.ones(2))
  same_on_every_rank(comm, raised.value)


def test_a_failed_check_is_raised_again_without_a_new_round(comm, monkeypatch):
  """Any error of a plain jax.jit step's check (here a RuntimeError of its round) is kept:
  every later lowering raises it again, no rank opens another round."""
  gather = gathered(comm)
  lowered = jax.jit(lambda x: gather(x)).trace(jnp.ones(2))  # a step no other test agreed on
  opened = rounds(monkeypatch, RuntimeError("the round failed"))
  for _ in range(2):
    with pytest.raises(RuntimeError, match="the round failed"):
      lowered.lower()
  assert len(opened) == 1, opened


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


@JITS
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "jax.grad"])
def test_an_exchange_inside_jax_checkpoint_is_refused_on_every_rank(comm, jit, grad):
  """jax.checkpoint (remat) traces its body again for the backward, so an exchange in it
  would run more often than paired: refused on every rank, naming jax.checkpoint (JAX's
  own check of remat's effects lets the refusal through instead of failing first)."""
  body = jax.checkpoint(gathered(comm))
  step = (lambda x: jax.grad(lambda x: body(x).sum())(x)) if grad else body
  with pytest.raises(F.ExchangeError, match="called inside a jax.checkpoint") as raised:
    jit(step, comm)(jnp.ones(2))
  same_on_every_rank(comm, raised.value)


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


@multi_rank
def test_a_chain_rank_that_holds_no_stage_runs_under_plain_jit(comm):
  """A MultiNodeChain over ranks 0 and 1, every rank's step under plain ``jax.jit``: a rank
  that holds no stage (from 3 ranks up) takes part in the step's check instead of leaving
  the others waiting in it; the stages' gradients equal the whole chain's in one process."""
  import flax.linen as nn

  chain = mnjax.model_parallel.MultiNodeChain(comm, [(nn.Dense(4), 0), (nn.Dense(2), 1)])
  x, y = jnp.linspace(-1.0, 1.0, 15).reshape(3, 5), jnp.zeros((3, 2))

  def loss(out, target):
    return jnp.mean((out - target) ** 2)

  everything = chain.init_all(jax.random.key(0), x)
  params = {k: everything[k] for k in chain.init(jax.random.key(0), x)}
  step = jax.jit(jax.grad(lambda p: chain.loss(p, x, y, loss)))
  for _ in range(2):  # the second call runs the compiled step again: nothing left to check
    grads = jax.block_until_ready(step(params))
  whole = jax.grad(lambda p: loss(chain.apply_all(p, x), y))(everything)
  assert sorted(grads) == [f"stage_{s}" for s in chain.own_stages]
  for key, value in grads.items():
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 value, whole[key])


@multi_rank
@JITS
def test_two_communicators_of_the_same_ranks_pair_each_over_its_own(comm, jit):
  """Ranks 0 and 1 exchange over the job's communicator and over a split of it holding the
  same ranks: a send meets the recv over the same communicator (it runs, on any rank order
  of first use), and a recv over the other one is refused on every rank, never waited for."""
  # Ranks 0 and 1 only: from 3 ranks up, the idle ranks' check is over `comm` (the largest).
  sub = comm.split(0 if comm.rank < 2 else None)
  like = jax.ShapeDtypeStruct((3,), jnp.float32)
  x = jnp.arange(3.0)

  def valid():
    if comm.rank == 0:
      return F.pseudo_connect(F.send(x, comm, 1), F.recv(sub, 1, like))
    return F.send(F.recv(comm, 0, like) * 2.0, sub, 0)

  run = (lambda fn: jit(fn, comm)()) if comm.rank < 2 else (lambda fn: idle(comm))
  out = jax.block_until_ready(run(valid))
  if comm.rank == 0:
    np.testing.assert_array_equal(out, 2.0 * np.arange(3.0))

  def crossed():  # rank 1 receives over the split what rank 0 sends over the job's
    if comm.rank == 0:
      return F.pseudo_connect(F.send(x, comm, 1), F.recv(sub, 1, like))
    return F.send(F.recv(sub, 0, like), comm, 0)

  with pytest.raises(preflight.pairing.ExchangeError,
                     match="over another communicator of the same ranks"):
    jax.block_until_ready(run(crossed))
