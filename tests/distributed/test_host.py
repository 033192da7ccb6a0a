"""Host collectives across ranks: `mean_metrics` (a host-level pmean), exact host sums, the
tree check every host collective makes first, and the per-leaf digests (run in 1 process and
under mpirun -n 2 and -n 3; assertions scale with comm.size)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mnjax
from mnjax.comm._host import _broadcast as host
from mnjax.comm._host import _digest as digest


def rank_losses(rank):
  """Rank r holds r + 1 examples (uneven shards), with per-example losses 10 r, 10 r + 1, ..."""
  return 10.0 * rank + np.arange(rank + 1)


def test_mean_metrics_is_the_exact_mean_over_uneven_ranks(comm):
  losses = rank_losses(comm.rank)
  metrics = {"loss": jnp.float32(losses.mean()), "pair": losses[0] * np.array([1.0, 2.0])}
  out = mnjax.mean_metrics(metrics, comm, weight=len(losses))
  everything = np.concatenate([rank_losses(r) for r in range(comm.size)])
  assert out["loss"] == pytest.approx(everything.mean(), rel=1e-6)
  assert isinstance(out["loss"], float)
  weights = np.arange(1, comm.size + 1)  # an array leaf is averaged element by element
  pair = (weights * 10.0 * np.arange(comm.size)).sum() / weights.sum() * np.array([1.0, 2.0])
  np.testing.assert_allclose(out["pair"], pair)
  if comm.size > 1:  # non-vacuous: the unweighted mean of the ranks' means is another number
    assert np.mean([rank_losses(r).mean() for r in range(comm.size)]) != pytest.approx(
        everything.mean())


def test_mean_metrics_by_default_averages_ranks_equally_like_pmean(comm):
  out = mnjax.mean_metrics({"x": np.full(3, float(comm.rank)), "y": comm.rank}, comm)
  np.testing.assert_allclose(out["x"], np.full(3, (comm.size - 1) / 2))
  assert out["x"].dtype == np.float64
  assert out["y"] == pytest.approx((comm.size - 1) / 2)


def test_values_equal_on_every_rank_come_back_unchanged(comm):
  # A learning rate is not disguised as a sum: it is the same everywhere and stays exact,
  # whatever the weights (a weighted mean of equal values may round).
  metrics = {"lr": jnp.float32(0.1), "step": 7, "classes": np.arange(3, dtype=np.int32),
             "loss": float(comm.rank)}
  out = mnjax.mean_metrics(metrics, comm, weight=comm.rank + 1)
  assert out["lr"] == float(np.float32(0.1)) and out["step"] == 7
  assert isinstance(out["step"], int)
  assert out["classes"].dtype == np.int32 and out["classes"].tolist() == [0, 1, 2]
  total = sum(r * (r + 1) for r in range(comm.size)) / sum(range(1, comm.size + 1))
  assert out["loss"] == pytest.approx(total)


def test_a_rank_without_examples_is_left_out_even_with_nan_means(comm):
  if comm.size == 1:
    pytest.skip("needs a rank with examples besides the empty one (runs under mpirun)")
  empty = comm.rank == 0
  out = mnjax.mean_metrics({"loss": np.nan if empty else float(comm.rank), "lr": 0.5}, comm,
                           weight=0 if empty else 2)
  assert out["loss"] == pytest.approx(np.mean(range(1, comm.size)))
  assert out["lr"] == 0.5


def test_a_bad_weight_on_one_rank_raises_on_every_rank(comm):
  bad = comm.rank == comm.size - 1
  with pytest.raises(ValueError, match="weight must be a finite number >= 0 on every rank"):
    mnjax.mean_metrics({"loss": 1.0}, comm, weight=-1 if bad else 4)
  with pytest.raises(ValueError, match="weight must be a finite number"):
    mnjax.mean_metrics({"loss": 1.0}, comm, weight=np.ones(2) if bad else 4)
  with pytest.raises(ValueError, match="the weights sum to 0 over all ranks"):
    mnjax.mean_metrics({"loss": 1.0}, comm, weight=0)
  assert comm.mpi_comm.allreduce(1) == comm.size  # the ranks are still in step


def test_mean_metrics_refuses_different_trees_and_non_numbers_on_every_rank(comm):
  if comm.size > 1:
    local = {"loss": 1.0, **({"extra": 2.0} if comm.rank == comm.size - 1 else {})}
    with pytest.raises(ValueError, match=rf"rank\(s\) \[{comm.size - 1}\] differs from rank 0"):
      mnjax.mean_metrics(local, comm)
  with pytest.raises(TypeError, match=r"leaf \['name'\] has dtype <U6; expected numbers"):
    mnjax.mean_metrics({"loss": 1.0, "name": "resnet"}, comm)
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_allreduce_metrics_now_checks_the_tree_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip("a mismatch needs two ranks (runs under mpirun)")
  # An integer count on one rank and a float on the others would have fused into buffers
  # of different lengths; now every rank names the leaf.
  local = {"count": 3 if comm.rank == comm.size - 1 else 3.0, "loss_sum": 1.0}
  with pytest.raises(ValueError, match=rf"rank {comm.size - 1} leaf \['count'\] \(\) int64"
                                       r" vs rank 0 leaf \['count'\] \(\) float64"):
    mnjax.allreduce_metrics(local, comm)
  assert comm.mpi_comm.allreduce(1) == comm.size


def test_host_sums_are_exact_and_take_16_bit_floats(comm):
  big = 2**53 + 1  # not a float64
  tree = {"n": np.int64(big), "flag": True, "half": jnp.full(2, 0.5, jnp.bfloat16),
          "z": np.complex64(1 + 2j)}
  out = host.allreduce(tree, comm)
  assert int(out["n"]) == big * comm.size and out["n"].dtype == np.int64
  assert int(out["flag"]) == comm.size
  assert out["half"].dtype == np.float64 and out["half"].tolist() == [0.5 * comm.size] * 2
  assert complex(out["z"]) == (1 + 2j) * comm.size
  stats = mnjax.nn.allreduce_persistent({"mean": jnp.full(2, comm.rank, jnp.bfloat16)}, comm)
  assert stats["mean"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(stats["mean"], np.float32), (comm.size - 1) / 2)


def test_one_signature_for_every_check():
  # The pre-flight check, the checkpoints and the host collectives compare the same thing.
  from mnjax.comm._host import _signature as signature

  assert mnjax.guard.tree_signature is signature.tree_signature
  assert signature.tree_signature(jnp.zeros((2, 3))) == (("<root>", (2, 3), "float32"),)
  assert signature.leaf_paths({"b": [1, 2], "a": 0}) == ["['a']", "['b'][0]", "['b'][1]"]


def test_compare_digests_names_what_differs():
  tree = {"w": np.arange(4.0), "b": np.zeros(2, np.float32)}
  reference = digest.tree_digests(tree)
  assert digest.compare_digests(reference, digest.tree_digests(jax.tree.map(np.copy, tree))) == {}
  flipped = np.arange(4.0)
  flipped.view(np.uint8)[3] ^= 1
  assert digest.compare_digests(reference, digest.tree_digests({**tree, "w": flipped})) == {
      "['w']": ""}
  assert digest.compare_digests(reference, digest.tree_digests({"w": tree["w"]})) == {
      "['b']": "lacks it"}
  # A same-bytes leaf of another shape or dtype is another leaf.
  assert digest.compare_digests(reference, digest.tree_digests(
      {**tree, "w": tree["w"].reshape(2, 2)})) == {"['w']": ""}
  copies = {"['w']": [reference["['w']"][0], "0" * 32, reference["['w']"][0]]}
  assert digest.compare_digests(reference, copies) == {"['b']": "lacks it", "['w']": "device [1]"}


def test_replicas_compared_across_ranks(comm):
  mine = digest.tree_digests({"w": np.full(3, float(comm.rank == comm.size - 1))})
  differing, leaves = digest.compare_across_ranks(mine, comm)
  assert leaves == 1
  assert differing == ({} if comm.size == 1 else {"['w']": [f"rank {comm.size - 1}"]})
