"""Device selection for the usual GPU layouts (pure logic: `plan_devices` in
`mnjax/comm/_devices.py`) and mpi4jax's CUDA set-up (`mnjax/comm/_cuda_mpi.py`), which this
machine can check without a GPU."""

import pytest

from mnjax.comm import _cuda_mpi as cuda_mpi
from mnjax.comm._devices import Layout, plan_devices

MULTI = ["hierarchical", "two_dimensional", "xla"]


def node(visible, intra_size, *, shared, platform="gpu"):
  return [Layout(platform, visible, r, intra_size, shared) for r in range(intra_size)]


def test_eight_gpus_one_process_per_gpu():
  assert [plan_devices("flat", lay) for lay in node(8, 8, shared=True)] == [(r,) for r in range(8)]


def test_eight_gpus_one_process_per_node_drives_all():
  (layout,) = node(8, 1, shared=True)
  for kind in MULTI:
    assert plan_devices(kind, layout) == tuple(range(8))
  assert plan_devices("flat", layout) == (0,)
  assert plan_devices("hierarchical", layout, requested=4) == (0, 1, 2, 3)


def test_gpus_per_task_one_each_process_drives_its_own():
  """srun --gpus-per-task=1: every task sees its own GPU as ordinal 0."""
  assert [plan_devices("flat", lay) for lay in node(1, 8, shared=False)] == [(0,)] * 8
  assert [plan_devices("xla", lay) for lay in node(1, 8, shared=False)] == [(0,)] * 8


def test_two_processes_per_node_split_the_gpus():
  assert [plan_devices("two_dimensional", lay) for lay in node(8, 2, shared=True)] == [
      (0, 1, 2, 3), (4, 5, 6, 7)]
  assert [plan_devices("xla", lay) for lay in node(4, 2, shared=False)] == [(0, 1, 2, 3)] * 2


@pytest.mark.parametrize("kind", ["flat", *MULTI])
def test_more_processes_than_gpus_is_an_error(kind):
  with pytest.raises(ValueError, match=r"16 processes|cannot give each") as error:
    plan_devices(kind, Layout("gpu", 8, 9, 16, shared=True))
  assert "share_devices=True" in str(error.value) or "local_devices" in str(error.value)


def test_sharing_gpus_deliberately():
  assert [plan_devices("flat", lay, share_devices=True) for lay in node(1, 2, shared=True)] == [
      (0,), (0,)]
  assert [plan_devices("hierarchical", lay, share_devices=True) for lay in node(1, 2, shared=True)
          ] == [(0,), (0,)]


def test_cpu_devices_are_private_and_may_be_shared():
  """Emulated CPU devices: flat places node-local rank i on device i (mod count); the
  multi-device kinds drive all of a process's devices."""
  assert [plan_devices("flat", lay) for lay in node(2, 3, shared=False, platform="cpu")] == [
      (0,), (1,), (0,)]
  assert plan_devices("two_dimensional", Layout("cpu", 2, 1, 2, False)) == (0, 1)
  with pytest.raises(ValueError, match="3 local devices requested"):
    plan_devices("hierarchical", Layout("cpu", 2, 0, 1, False), requested=3)


def test_flat_refuses_several_devices_and_nothing_visible_is_an_error():
  with pytest.raises(ValueError, match="drives one device per process"):
    plan_devices("flat", Layout("gpu", 8, 0, 1, True), requested=2)
  with pytest.raises(ValueError, match="no gpu device is visible"):
    plan_devices("flat", Layout("gpu", 0, 0, 1, True))


@pytest.fixture
def fresh_cuda_mpi(monkeypatch):
  from mpi4jax._src import decorators, xla_bridge

  monkeypatch.setattr(cuda_mpi, "_configured", None)
  monkeypatch.setattr(decorators, "_cuda_mpi_setup_done", False)
  return xla_bridge


def test_unset_copy_mode_fails_with_instructions(fresh_cuda_mpi):
  if not fresh_cuda_mpi.HAS_CUDA_EXT:
    pytest.skip("this machine built mpi4jax without CUDA (no toolkit headers)")
  with pytest.raises(RuntimeError, match="set MPI4JAX_USE_CUDA_MPI before"):
    cuda_mpi.configure({})


def test_missing_cuda_extension_fails_with_instructions(fresh_cuda_mpi, monkeypatch):
  monkeypatch.setattr(fresh_cuda_mpi, "HAS_CUDA_EXT", False)
  with pytest.raises(RuntimeError, match="MNJAX_EXTRAS=cuda scripts/setup.sh"):
    cuda_mpi.configure({cuda_mpi.ENV: "0"})


def test_cuda_aware_mode_is_refused_by_an_mpi_without_cuda(fresh_cuda_mpi):
  if not fresh_cuda_mpi.HAS_CUDA_EXT:
    pytest.skip("this machine built mpi4jax without CUDA (no toolkit headers)")
  assert cuda_mpi.mpi_reports_cuda() is False  # the mpich wheel says so
  with pytest.raises(RuntimeError, match="reports no CUDA support"):
    cuda_mpi.configure({cuda_mpi.ENV: "1"})


def test_copy_to_host_mode_is_set_explicitly(fresh_cuda_mpi, monkeypatch):
  if not fresh_cuda_mpi.HAS_CUDA_EXT:
    pytest.skip("this machine built mpi4jax without CUDA (no toolkit headers)")
  calls = []
  monkeypatch.setattr(fresh_cuda_mpi.mpi_xla_bridge_cuda, "set_copy_to_host", calls.append)
  assert cuda_mpi.configure({cuda_mpi.ENV: "0"}) is False
  assert calls == [True]
  from mpi4jax._src import decorators

  assert decorators._cuda_mpi_setup_done  # mpi4jax's own set-up will not warn and skip
