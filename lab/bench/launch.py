"""Re-launching a benchmark under mpirun, and the workload shapes benchmarks share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["emulated_devices_env", "relaunch", "resnet50_shapes"]


def relaunch(benchmark: str, argv: list[str], *, ranks: int, bind: str = "core",
             env: dict[str, str] | None = None, timeout: float = 1800) -> dict:
  """Runs ``mpirun -n ranks python -m lab.bench <benchmark> <argv>``; rank 0's last JSON line.

  Ranks are bound to cores (``--bind-to core``) as on a cluster: unbound, two ranks on two
  cores steal time from each other while one waits in MPI (measured in lab.bench.step).

  Example:
    >>> relaunch("step", ["--worker"], ranks=2)["efficiency"]  # doctest: +SKIP
    0.97...
  """
  mpirun = Path(sys.executable).with_name("mpirun")
  cmd = [str(mpirun if mpirun.exists() else "mpirun"), "--bind-to", bind, "-n", str(ranks),
         sys.executable, "-m", "lab.bench", benchmark, *argv]
  full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_"))}
  full_env.update(env or {})
  out = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def emulated_devices_env(devices: int) -> dict[str, str]:
  """``XLA_FLAGS`` for `relaunch`: the caller's flags, then `devices` emulated CPU devices.

  Example:
    >>> emulated_devices_env(2)["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")
    True
  """
  flag = f"--xla_force_host_platform_device_count={devices}"
  return {"XLA_FLAGS": " ".join(f for f in [os.environ.get("XLA_FLAGS", ""), flag] if f)}


def resnet50_shapes() -> list[tuple[int, ...]]:
  """ResNet-50's 161 parameter shapes (`lab.models.ResNet50`, 1000 classes), 25,557,032 floats.

  Example:
    >>> import math
    >>> len(resnet50_shapes()), sum(math.prod(s) for s in resnet50_shapes())
    (161, 25557032)
  """
  import jax
  import jax.numpy as jnp

  from lab.models import ResNet50

  variables = jax.eval_shape(
      lambda: ResNet50().init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False))
  return [leaf.shape for leaf in jax.tree.leaves(variables["params"])]
