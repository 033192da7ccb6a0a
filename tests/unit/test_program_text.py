"""The canonical program text (mnjax/guard/_program.py): what is compared, what is not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mnjax.guard import _program as program


def prog(fn, *args, sources=False):
  return program.program_of(jax.make_jaxpr(fn)(*args), sources=sources)


def test_the_same_function_gives_the_same_program_and_digest():
  f = lambda x: jnp.tanh(x * 2.0).sum()
  assert prog(f, jnp.ones(3)) == prog(f, jnp.ones(3))
  assert prog(f, jnp.ones(3)).digest() == prog(f, jnp.ones(3)).digest()


def test_arguments_are_compared_by_shape_and_dtype_only():
  f = lambda x: x + 1.0
  assert prog(f, jnp.zeros(3)).digest() == prog(f, jnp.full(3, 7.0)).digest()
  assert prog(f, jnp.zeros(3)).digest() != prog(f, jnp.zeros(4)).digest()
  assert prog(f, jnp.zeros(3)).digest() != prog(f, jnp.zeros(3, jnp.int32)).digest()


def test_literals_constants_and_hyperparameters_are_compared_by_value():
  assert prog(lambda x: x * 0.01, 1.0).digest() != prog(lambda x: x * 0.1, 1.0).digest()
  big_a, big_b = jnp.zeros(100), jnp.zeros(100).at[57].set(1.0)
  assert (prog(lambda x: x + big_a, jnp.ones(100)).digest()
          != prog(lambda x: x + big_b, jnp.ones(100)).digest())

  def adam_step(lr):
    tx = optax.adam(lr)
    return prog(lambda g: tx.update(g, tx.init(g), g)[0], jnp.ones(3))
  assert adam_step(1e-3).digest() != adam_step(2e-3).digest()
  assert adam_step(1e-3).digest() == adam_step(1e-3).digest()


def test_nested_programs_are_compared_inline():
  def f(k):
    return lambda x: jax.lax.fori_loop(0, k, lambda i, v: v * 2.0, x)
  assert prog(f(3), 1.0).digest() != prog(f(4), 1.0).digest()

  def g(c):
    return lambda x: jax.lax.cond(x > 0, lambda v: v * c, lambda v: v, x)
  assert prog(g(2.0), 1.0).digest() != prog(g(3.0), 1.0).digest()


def test_communicator_handles_and_addresses_are_not_compared():
  op = program.Op(0, "p", (("comm_handle", "<this rank's communicator>"),), (), ())
  assert program._param(object()) == program._param(object())  # no "at 0x..."
  assert op.params[0][1] == "<this rank's communicator>"


def test_the_message_names_the_first_difference_and_its_source():
  a = prog(lambda x: jnp.sin(x) * 0.01, 1.0, sources=True)
  b = prog(lambda x: jnp.sin(x) * 0.1, 1.0, sources=True)
  message = program.describe_programs([a, a, b], caller="data_parallel")
  assert "rank 2 differs from rank 0 at operation 3" in message
  assert "literal 0.01:f32[] on rank 0, literal 0.1:f32[] on rank 2" in message
  assert "test_program_text.py" in message  # the user's own line
  assert "rank 1" not in message  # rank 1 agrees


def test_a_longer_program_on_one_rank_is_described():
  a = prog(lambda x: x * 2.0, 1.0, sources=True)
  b = prog(lambda x: (x * 2.0) + 1.0, 1.0, sources=True)
  assert "the operation is `return` on rank 0, `add` on rank 1" in program.describe_programs(
      [a, b], caller="c")


def test_user_collectives_skips_mnjax_and_the_allowed_scope():
  def f(x):
    with jax.named_scope("allowed"):
      y = jax.lax.psum(x, "i")
    return jax.lax.pmax(x, "i") + y
  closed = jax.make_jaxpr(f, axis_env=[("i", 2)])(1.0)
  found = program.user_collectives(closed, "i", allowed_scope="allowed")
  assert len(found) == 1 and found[0].startswith("pmax over 'i' from")
  assert program.user_collectives(closed, "j", allowed_scope="allowed") == []


def test_small_constants_are_shown_and_large_ones_hashed():
  assert program._value(np.float32(0.5)) == "0.5"
  assert "hashing to" in program._value(np.zeros(100))
