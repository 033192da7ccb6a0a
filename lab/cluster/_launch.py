"""One MPI job across the emulated nodes: plain ``mpirun`` in the hub namespace, with hydra's
``rsh`` launcher replaced by a small wrapper that enters the node's network namespace and a
UTS namespace of its own (hostname ``node<i>``) before it starts hydra's proxy.

MPICH places ranks by proxy, so shared memory is used only among a node's ranks. Its UCX
netmod would otherwise reach across namespaces through ``/dev/shm`` and process-to-process
copies (every namespace shares them: measured here, 100 MB allreduced with no byte on the
veth), so the job gets ``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES=eth0``: between nodes
every byte crosses the shaped uplink, which the byte-count tests check.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from lab.cluster._net import HUB_ADDRESS, Cluster, ClusterError, down, rate_bits, up

# What the job's MPI must use between namespaces; a user's own setting wins.
NETWORK_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp",
               "FI_TCP_IFACE": "eth0"}


def _mpirun() -> str:
  here = Path(sys.executable).parent / "mpirun"
  found = str(here) if here.exists() else shutil.which("mpirun")
  if found is None:
    raise ClusterError("no mpirun next to this Python or on PATH (pip install mpich)")
  return found


def _wrapper(c: Cluster, folder: Path) -> Path:
  """hydra calls ``<wrapper> <host> <command line>`` (as it would call rsh)."""
  cases = "\n".join(
      f"  {c.address(i)}) ns={c.node(i)}; hn={c.hostname(i)} ;;" for i in range(c.nodes))
  text = f"""#!/bin/sh
host="$1"; shift
case "$host" in
{cases}
  *) echo "lab.cluster: no node at $host" >&2; exit 2 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $hn && exec $*"
"""
  path = folder / "enter_node.sh"
  path.write_text(text)
  path.chmod(0o755)
  return path


def command(c: Cluster, cmd: list[str], ranks_per_node: int, wrapper: Path) -> list[str]:
  """The ``mpirun`` line (run in the hub namespace) for `cmd` on every node of `c`."""
  hosts = ",".join(c.address(i) for i in range(c.nodes))
  return ["ip", "netns", "exec", c.hub, _mpirun(), "-launcher", "rsh", "-launcher-exec",
          str(wrapper), "-localhost", HUB_ADDRESS, "-hosts", hosts, "-ppn",
          str(ranks_per_node), "-n", str(c.nodes * ranks_per_node), *cmd]


def job_env(devices_per_rank: int | None) -> dict:
  """The job's environment: this one, the TCP-only netmod, and the emulated device count."""
  env = {**NETWORK_ENV, **os.environ}
  if devices_per_rank is not None:
    flag = f"--xla_force_host_platform_device_count={devices_per_rank}"
    env["XLA_FLAGS"] = " ".join(f for f in [env.get("XLA_FLAGS", ""), flag] if f)
  return env


def _on_signal(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def run(cmd: list[str], *, nodes: int, rate: str, ranks_per_node: int = 1,
        devices_per_rank: int | None = None, bytes_json: str | None = None,
        timeout: float | None = None) -> int:
  """Runs `cmd` as one MPI job of ``nodes x ranks_per_node`` ranks; returns its exit code.

  Builds the cluster, runs the job, writes each node's uplink tx/rx bytes during the job to
  `bytes_json`, and tears the cluster down (also on an exception or SIGTERM/SIGINT/SIGHUP; a
  SIGKILLed run's cluster is swept by the next `up`, or by ``python -m lab.cluster down``).

  >>> try:
  ...   run(["true"], nodes=2, rate="fast")
  ... except ClusterError as e:
  ...   print(str(e)[:14])
  rate 'fast': e
  """
  if not cmd:
    raise ClusterError("no command to run: python -m lab.cluster run --nodes N --rate R -- CMD")
  if ranks_per_node < 1 or (devices_per_rank is not None and devices_per_rank < 1):
    raise ClusterError(f"ranks per node and devices per rank must be >= 1, got "
                       f"{ranks_per_node} and {devices_per_rank}")
  rate_bits(rate)
  old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
  c = None
  try:
    c = up(nodes, rate)
    with tempfile.TemporaryDirectory(prefix="mnjaxc-") as folder:
      line = command(c, list(cmd), ranks_per_node, _wrapper(c, Path(folder)))
      before = c.counters()
      proc = subprocess.Popen(line, env=job_env(devices_per_rank), start_new_session=True)
      try:
        code = proc.wait(timeout=timeout)
      except BaseException as e:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
          raise ClusterError(f"the job did not finish within {timeout:.0f} s; killed it "
                             f"(a hang? raise --timeout)") from None
        raise
      after = c.counters()
    if bytes_json:
      rows = [{"name": a["name"], "tx_bytes": a["tx_bytes"] - b["tx_bytes"],
               "rx_bytes": a["rx_bytes"] - b["rx_bytes"]} for a, b in zip(after, before)]
      Path(bytes_json).write_text(json.dumps(
          {"nodes": rows, "rate": rate, "ranks_per_node": ranks_per_node,
           "devices_per_rank": devices_per_rank, "command": shlex.join(cmd),
           "returncode": code}, indent=1))
    return code
  finally:
    if c is not None:
      down(c.tag)
    for s, h in old.items():
      signal.signal(s, h)
