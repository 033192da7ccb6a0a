"""Bad device layouts give a clear error on every rank, not a hang or a segfault."""

import textwrap

import pytest
from support.launch import run_mpi

from mnjax.comm import _devices as devices

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

CREATE = "import mnjax; mnjax.create_communicator({kind!r})"


def run(ranks, code, env=None):
  return run_mpi(ranks, ["-c", textwrap.dedent(code)], timeout=120, env=env)


def test_a_gpu_requested_where_jax_sees_none():
  result = run(2, CREATE.format(kind="flat"), env={"JAX_PLATFORMS": "cuda"})
  assert result.returncode != 0
  assert result.stdout.count("JAX could not start its backend") >= 2, result.stdout[-3000:]
  assert "JAX_PLATFORMS=cpu" in result.stdout


def test_processes_driving_different_device_counts():
  # Rank 1 sees one CPU device, rank 0 two: the mapped step could not run.
  code = """
      import os
      from mpi4py import MPI
      n = 2 - MPI.COMM_WORLD.rank
      os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
      import mnjax
      mnjax.create_communicator("hierarchical")
  """
  result = run(2, code)
  assert result.returncode != 0
  assert (result.stdout.count("drive different numbers of devices ([2, 1]") >= 2
          ), result.stdout[-3000:]


def test_the_cuda_plugin_without_a_usable_gpu(monkeypatch):
  monkeypatch.setattr(devices, "cuda_plugin_installed", lambda: True)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  with pytest.raises(ValueError, match="CUDA plugin is installed but JAX started on the CPU"):
    devices._cpu_devices()
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert devices._cpu_devices()  # deliberate CPU runs are fine


def test_gpus_are_expected_only_with_the_plugin_and_a_visible_gpu(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(devices, "cuda_plugin_installed", lambda: True)
  assert devices.gpus_expected(("0000:1b:00.0",))
  assert not devices.gpus_expected(())
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert not devices.gpus_expected(("0000:1b:00.0",))
  monkeypatch.setattr(devices, "cuda_plugin_installed", lambda: False)
  monkeypatch.delenv("JAX_PLATFORMS")
  assert not devices.gpus_expected(("0000:1b:00.0",))


def test_auto_picks_flat_without_gpus():
  from mnjax.comm._create import resolve_kind

  if devices.gpu_inventory():
    pytest.skip("this machine has GPUs (the xla case is python -m lab.bench gpu's)")
  assert resolve_kind("auto") == "flat"


def test_jax_started_on_some_ranks_only():
  code = """
      from mpi4py import MPI
      import jax
      if MPI.COMM_WORLD.rank == 0:
        jax.devices()
      import mnjax
      mnjax.create_communicator("flat")
  """
  result = run(2, code)
  assert result.returncode != 0
  assert result.stdout.count("JAX was already started") >= 2, result.stdout[-3000:]
