"""Pre-flight: ranks that would exchange different gradient trees are stopped, on every rank,
before any collective (run in 1 process and under mpirun -n 2 and -n 3).

The last rank builds a different tree; every rank must raise the same error, naming the leaf,
the rank and both shapes/dtypes, and no allreduce may have run on any rank.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax
from mnjax.comm._instep import _native as native
from mnjax.guard import _preflight as preflight

REFERENCE = {"dense": {"kernel": ((4, 6), jnp.float32), "bias": ((6,), jnp.float32)}}

# name -> (the odd rank's tree, what the message must say)
CASES = {
    "shape": ({"dense": {"kernel": ((4, 7), jnp.float32), "bias": ((6,), jnp.float32)}},
              r"leaf \['dense'\]\['kernel'\] is float32\[4, 7\] vs float32\[4, 6\]"),
    "same_size_reshape": (
        {"dense": {"kernel": ((6, 4), jnp.float32), "bias": ((6,), jnp.float32)}},
        r"leaf \['dense'\]\['kernel'\] is float32\[6, 4\] vs float32\[4, 6\] \(same element"
        r" count: MPI would have summed them silently\)"),
    "dtype": ({"dense": {"kernel": ((4, 6), jnp.bfloat16), "bias": ((6,), jnp.float32)}},
              r"leaf \['dense'\]\['kernel'\] is bfloat16\[4, 6\] vs float32\[4, 6\]"),
    "extra_leaf": ({"dense": {"kernel": ((4, 6), jnp.float32), "bias": ((6,), jnp.float32),
                              "scale": ((6,), jnp.float32)}},
                   r"leaf \['dense'\]\['scale'\] float32\[6\] exists only on this rank"),
}


def build(spec):
  return jax.tree.map(lambda s: jnp.ones(*s), spec, is_leaf=lambda s: isinstance(s, tuple))


def run_step(tx, params):
  @jax.jit
  def step(params, opt_state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step(params, tx.init(params))


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_gradient_trees_raise_on_every_rank_before_any_allreduce(comm, case):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  odd, message = CASES[case]
  params = build(odd if comm.rank == comm.size - 1 else REFERENCE)
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1))
  before = native.allreduce_calls()
  with pytest.raises(ValueError, match=rf"rank {comm.size - 1} vs rank 0: {message}") as info:
    run_step(tx, params)
  assert "ranks disagree on the gradients to exchange" in str(info.value)
  assert native.allreduce_calls() == before  # nothing was exchanged, on any rank
  # Every rank raised the same message.
  assert len(set(comm.mpi_comm.allgather(str(info.value)))) == 1


def test_mismatched_options_are_named(comm):
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  wire = jnp.bfloat16 if comm.rank == comm.size - 1 else None
  tx = optax.chain(mnjax.allreduce_gradients(comm, wire_dtype=wire), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"wire_dtype is 'bfloat16' vs 'None'"):
    run_step(tx, build(REFERENCE))


def test_check_runs_once_per_trace_not_per_step(comm, monkeypatch):
  calls = []
  original = preflight.check_same_on_all_ranks
  monkeypatch.setattr(preflight, "check_same_on_all_ranks",
                      lambda *a, **k: calls.append(1) or original(*a, **k))
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.sgd(0.1))
  params = build(REFERENCE)

  @jax.jit
  def step(params, opt_state):
    updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  before = native.allreduce_calls()
  for _ in range(3):
    params, opt_state = step(params, opt_state)
  jax.block_until_ready(params)
  assert calls == [1]
  assert native.allreduce_calls() - before == (0 if comm.size == 1 else 3)
  np.testing.assert_allclose(params["dense"]["bias"], 1 - 3 * 0.1, rtol=1e-6)


def test_message_for_each_case_names_leaf_and_ranks():
  # The message itself, from signatures as four ranks would send them (no MPI needed).
  ref = {"gradient tree": preflight.tree_signature(build(REFERENCE))}
  for case, (odd, message) in CASES.items():
    odd_sig = {"gradient tree": preflight.tree_signature(build(odd))}
    text = preflight.describe_mismatch([ref, ref, odd_sig, ref], "the gradients", "caller")
    assert len(re.findall(rf"rank 2 vs rank 0: {message}", text)) == 1, (case, text)
    assert "rank 1 vs" not in text and "rank 3 vs" not in text


def test_timeout_must_be_positive(comm):
  with pytest.raises(ValueError, match="preflight_timeout must be a positive number"):
    mnjax.allreduce_gradients(comm, preflight_timeout=0)


def test_a_group_names_the_world_rank_of_each_of_its_ranks(comm):
  """Over a communicator split from the job's (here in reverse order), the message numbers the
  group's ranks and says which rank of the job each one is."""
  if comm.size == 1:
    pytest.skip("needs ranks that disagree (runs under mpirun)")
  group = comm.split(0, key=comm.size - comm.rank)  # group rank r is world rank size - 1 - r
  odd = group.rank == group.size - 1  # world rank 0
  tx = optax.chain(mnjax.allreduce_gradients(group), optax.sgd(0.1))
  with pytest.raises(ValueError, match=rf"rank {group.size - 1} vs rank 0: .*"
                                       rf"rank 0 is world rank {comm.size - 1}, .*"
                                       rf"rank {group.size - 1} is world rank 0\.\)"):
    run_step(tx, build(CASES["shape"][0] if odd else REFERENCE))
