"""check_replicas: identical replicas pass; one drifting leaf is named, on every rank."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mnjax


def params():
  return {"conv": {"kernel": jnp.ones((3, 3, 2)), "bias": jnp.zeros(2)},
          "dense": {"kernel": jnp.full((4, 2), 0.5, jnp.bfloat16)}}


def test_identical_replicas_pass(comm):
  mnjax.check_replicas(params(), comm)


def test_a_drifted_leaf_on_the_last_rank_is_named_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip("needs two ranks (runs under mpirun); local devices are tested below")
  tree = params()
  if comm.rank == comm.size - 1:  # one bit of one element
    kernel = np.asarray(tree["dense"]["kernel"]).copy()
    kernel.view(np.uint16)[1, 1] ^= 1
    tree["dense"]["kernel"] = jnp.asarray(kernel)
  with pytest.raises(ValueError, match=(
      rf"1 of 3 leaves differ: \['dense'\]\['kernel'\]: rank {comm.size - 1} differ from rank 0")):
    mnjax.check_replicas(tree, comm)


def test_a_drifted_local_device_copy_is_named(comm):
  # A "replicated" array whose second device holds other values (the multi-device kinds
  # keep one copy per local device).
  devices = jax.local_devices()[:2]
  if len(devices) < 2:
    pytest.skip("needs two local devices")
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)),
                                        jax.sharding.PartitionSpec())
  copies = [jax.device_put(jnp.full(3, float(i)), d) for i, d in enumerate(devices)]
  drifted = jax.make_array_from_single_device_arrays((3,), sharding, copies)
  with pytest.raises(ValueError, match=r"1 of 2 leaves differ: \['w'\]: rank 0 device \[1\]"):
    mnjax.check_replicas({"w": drifted, "b": jnp.ones(2)}, comm)
