"""How many collectives SyncBatchNorm issues, what they carry, and what orders them.

One per layer forward and one backward, each ``[sum(x), sum(x^2)]`` plus one count (a row of
counts only with a mask); on ``xla`` (XLA's own psum, which XLA orders itself) the backward
sums of parallel layers depend on no other layer's, so XLA:GPU can combine and schedule them
as under plain ``jax.jit``. Lowered only, in one process (the communicator's ``size`` raised
to 2 for ``flat``; two emulated devices for ``xla``); nothing runs.
"""

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mnjax
from lab.bench.hlo_order import dependencies, depends_on, mpi_calls
from mnjax.comm._instep import _sequence as sequence

WIDTHS = (3, 5, 7)  # parallel branches after a stem of 4 features


class Net(nn.Module):
  norm: type
  masked: bool = False

  @nn.compact
  def __call__(self, x):
    mask = (x[..., :1] > -1e9) if self.masked else None
    x = nn.relu(self.norm(name="stem_norm")(nn.Dense(4)(x), mask=mask))
    outs = [self.norm(name=f"norm{i}")(nn.Dense(w)(x), mask=mask) for i, w in enumerate(WIDTHS)]
    return sum(o.sum() for o in outs)


def grad_step(norm, masked=False):
  net = Net(norm=functools.partial(norm, use_running_average=False), masked=masked)
  variables = net.init(jax.random.key(0), jnp.ones((4, 6)))

  def step(params, x):
    return jax.grad(lambda p: net.apply({"params": p, "batch_stats": variables["batch_stats"]},
                                        x, mutable=["batch_stats"])[0])(params)

  return step, variables["params"]


def payloads(text: str) -> list[int]:
  """Floats each MPI call of the lowered text carries (its first operand's size); an
  allreduce's done half, which only waits for its start, is not a call of its own."""
  lines = [ln for ln in text.splitlines()
           if re.search(r"custom_call\s*@\w*mpi", ln) and "_done" not in ln]
  return [int(re.search(r":\s*\(tensor<(\d+)xf32>", ln).group(1)) for ln in lines]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_flat_one_collective_per_layer_each_way_with_one_count(comm, masked):
  two = dataclasses.replace(comm, size=2)
  step, params = grad_step(functools.partial(mnjax.SyncBatchNorm, two), masked)
  with sequence.recording():  # as data_parallel traces it
    text = jax.jit(step).trace(params, jnp.ones((4, 6))).lower(
        lowering_platforms=("cpu",)).as_text()
  layers = (4, *WIDTHS)
  assert len(mpi_calls(text)) == 2 * len(layers)
  per_layer = [3 * c if masked else 2 * c + 1 for c in layers]
  # forward in call order, backward in reverse; a count row only when a mask can vary it
  assert payloads(text) == per_layer + per_layer[::-1]


def test_xla_backward_sums_of_parallel_layers_are_independent(comm):
  devices = jax.local_devices()[:2]
  if len(devices) < 2:
    pytest.skip("needs 2 devices (tests/conftest.py emulates them)")
  # This process's two devices as the xla kind's whole axis (create_communicator('xla')
  # would start jax.distributed, which a test process that already used JAX cannot).
  kc = dataclasses.replace(comm, kind="xla", size=1, rank=0, local_device_count=2,
                           axis_name="batch", devices=tuple(devices))
  step, params = grad_step(functools.partial(mnjax.SyncBatchNorm, kc))
  mesh = jax.sharding.Mesh(np.array(devices), (kc.axis_name,))
  mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(kc.axis_name)), out_specs=P(),
                         check_vma=False)  # as mnjax.data_parallel maps it
  text = jax.jit(mapped).lower(params, jnp.ones((4 * kc.num_replicas, 6))).as_text()
  sums = [ln.split("=")[0].strip().lstrip("%") for ln in text.splitlines()
          if "stablehlo.all_reduce" in ln and "=" in ln]
  layers = 1 + len(WIDTHS)
  assert len(sums) == 2 * layers
  deps = dependencies(text)
  backward_branches, backward_stem = sums[layers:-1], sums[-1]
  for a in backward_branches:  # before: each waited for the next one (the order chain)
    assert not any(depends_on(deps, a, b) for b in backward_branches if b != a), a
    assert depends_on(deps, backward_stem, a)  # the stem's needs theirs: data, not a chain
