"""One MPI job across emulated nodes, for the link benchmarks (`cluster`, its step part)."""

from __future__ import annotations

import subprocess
import sys


def cluster_job(worker: list[str], *, nodes, rate, ranks_per_node, devices) -> None:
  """Runs ``python -m <worker...>`` as one MPI job across emulated nodes; exits on failure."""
  cmd = [sys.executable, "-m", "lab.cluster", "run", "--nodes", str(nodes), "--rate", rate,
         "--ranks-per-node", str(ranks_per_node), "--timeout", "900"]
  if devices:
    cmd += ["--devices-per-rank", str(devices)]
  cmd += ["--", sys.executable, "-m", *worker]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise SystemExit(f"cluster job failed ({proc.returncode}): {' '.join(cmd)}\n"
                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
