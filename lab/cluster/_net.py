"""The emulated nodes: one network namespace per node, joined through veth pairs to a bridge in
a private hub namespace, each node's uplink shaped in both directions with tc ``tbf``.

Nothing is created in the machine's own network namespace: the bridge lives in the hub
namespace ``mnjaxc-<tag>-hub`` (which is also where ``mpirun`` runs), node ``i`` is
``mnjaxc-<tag>-n<i>`` with address ``10.231.0.<i+1>`` on its ``eth0``; the hub has
``10.231.0.254``. Deleting the namespaces deletes every veth, the bridge and the qdiscs, so
`down` only has to delete namespaces whose names start with the prefix (and kill what still
runs in them). Tags ``p<pid>`` belong to a `run` and are swept once that process is gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess

PREFIX = "mnjaxc-"
# `ip netns exec NS` bind-mounts the files of /etc/netns/NS/ over /etc/ (in its own mount
# namespace): each node's `hosts` names every node, so `node<i>` resolves to its address
# (jax.distributed's coordinator and gloo find peers by hostname).
NETNS_ETC = "/etc/netns"
SUBNET = "10.231.0"
HUB_ADDRESS = f"{SUBNET}.254"
MAX_NODES = 253
_RATE = re.compile(r"^(\d+(\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class ClusterError(RuntimeError):
  """The emulated cluster cannot be built or used here (the message says why and what to do)."""


def rate_bits(rate: str) -> float | None:
  """Bits per second of a tc rate such as ``"1gbit"``; None for ``"none"`` (unshaped).

  >>> rate_bits("10gbit"), rate_bits("none")
  (10000000000.0, None)
  """
  if rate.lower() in ("none", "unshaped"):
    return None
  m = _RATE.match(rate)
  if not m or float(m.group(1)) <= 0:
    raise ClusterError(f"rate {rate!r}: expected a positive tc rate such as 1gbit, 10gbit, "
                       f"500mbit, or 'none' for an unshaped link")
  return float(m.group(1)) * _UNIT[m.group(3).lower()]


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  out = subprocess.run(list(args), capture_output=True, text=True)
  if check and out.returncode != 0:
    raise ClusterError(f"`{' '.join(args)}` failed ({out.returncode}): "
                       f"{(out.stderr or out.stdout).strip()}")
  return out


def check_available() -> None:
  """Raises `ClusterError` saying why unless this process may build namespaces (root, ip, tc).

  >>> try:
  ...   check_available()
  ... except ClusterError as e:
  ...   pass
  """
  if os.geteuid() != 0:
    raise ClusterError("lab.cluster needs root (network namespaces, veth pairs and tc); "
                       "run it as root, or skip what needs it")
  for tool in ("ip", "tc", "unshare"):
    if shutil.which(tool) is None:
      raise ClusterError(f"lab.cluster needs `{tool}` on PATH (iproute2, util-linux)")
  probe = _sh("unshare", "--net", "--uts", "true", check=False)
  if probe.returncode != 0:
    raise ClusterError("network/UTS namespaces are not allowed here (`unshare --net --uts "
                       f"true`: {probe.stderr.strip()}); a container needs CAP_SYS_ADMIN")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A running emulated cluster: `nodes` namespaces behind one hub, uplinks shaped to `rate`."""

  tag: str
  nodes: int
  rate: str

  @property
  def hub(self) -> str:
    return f"{PREFIX}{self.tag}-hub"

  def node(self, i: int) -> str:
    return f"{PREFIX}{self.tag}-n{i}"

  def address(self, i: int) -> str:
    return f"{SUBNET}.{i + 1}"

  def hostname(self, i: int) -> str:
    return f"node{i}"

  def counters(self) -> list[dict]:
    """Each node's uplink (its ``eth0``) byte counters: ``{"name", "tx_bytes", "rx_bytes"}``."""
    rows = []
    for i in range(self.nodes):
      link = json.loads(_sh("ip", "-n", self.node(i), "-s", "-j", "link", "show", "dev",
                            "eth0").stdout)[0]
      stats = link["stats64"]
      rows.append({"name": self.hostname(i), "tx_bytes": stats["tx"]["bytes"],
                   "rx_bytes": stats["rx"]["bytes"]})
    return rows


def _namespaces() -> list[str]:
  out = _sh("ip", "netns", "list", check=False).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def down(tag: str | None = None) -> list[str]:
  """Deletes cluster `tag`'s namespaces (every ``mnjaxc-`` one when None); returns their names.

  Processes still inside are killed first, so nothing (veth, bridge, qdisc, mount) is left.

  >>> isinstance(down("doctest-none"), list)
  True
  """
  start = PREFIX if tag is None else f"{PREFIX}{tag}-"
  gone = []
  for name in _namespaces():
    if not name.startswith(start):
      continue
    for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
      try:
        os.kill(int(pid), 9)
      except (ProcessLookupError, ValueError):
        pass
    _sh("ip", "netns", "del", name, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    gone.append(name)
  left = set(_namespaces())  # a hosts folder whose namespace is gone (a crash in between)
  for name in os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []:
    if name.startswith(start) and name not in left:
      shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
  try:
    os.rmdir(NETNS_ETC)   # only if empty: ours were the only ones
  except OSError:
    pass
  return gone


def sweep_orphans() -> list[str]:
  """Deletes the clusters of `run` processes that are gone (a crash, SIGKILL)."""
  gone = []
  for name in _namespaces():
    m = re.match(rf"^{PREFIX}p(\d+)-", name)
    if m and not _alive(int(m.group(1))):
      gone += down(f"p{m.group(1)}")
  return gone


def burst_bytes(bits: float) -> int:
  """Bytes the shaper lets through at once from a full bucket: 2 ms at the rate, at least
  64 KiB (one GSO segment must fit in the bucket).

  Example:
    >>> burst_bytes(rate_bits("1gbit"))
    250000
  """
  return max(64 * 1024, int(bits / 8 * 0.002))


def _shape(ns: str, dev: str, bits: float) -> None:
  burst = burst_bytes(bits)
  _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits:.0f}bit",
      "burst", str(burst), "latency", "50ms")


def _write_hosts(c: Cluster) -> None:
  lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
  lines += [f"{c.address(i)} {c.hostname(i)}" for i in range(c.nodes)]
  for i in range(c.nodes):
    folder = os.path.join(NETNS_ETC, c.node(i))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hosts"), "w") as f:
      f.write("\n".join(lines) + "\n")


def up(nodes: int, rate: str, tag: str | None = None) -> Cluster:
  """Builds `nodes` emulated nodes with uplinks of `rate` (``"none"``: unshaped); returns it.

  On any failure everything built so far is deleted and `ClusterError` says why.

  >>> try:
  ...   up(0, "1gbit")
  ... except ClusterError as e:
  ...   print(str(e)[:30])
  nodes must be between 1 and 25
  """
  if not 1 <= nodes <= MAX_NODES:
    raise ClusterError(f"nodes must be between 1 and {MAX_NODES} (one /24 of addresses), "
                       f"got {nodes}")
  bits = rate_bits(rate)
  check_available()
  sweep_orphans()
  c = Cluster(tag or f"p{os.getpid()}", nodes, rate)
  if any(n.startswith(f"{PREFIX}{c.tag}-") for n in _namespaces()):
    raise ClusterError(f"cluster {c.tag!r} already exists: `python -m lab.cluster down "
                       f"--tag {c.tag}` first")
  try:
    _sh("ip", "netns", "add", c.hub)
    _sh("ip", "-n", c.hub, "link", "set", "lo", "up")
    _sh("ip", "-n", c.hub, "link", "add", "br0", "type", "bridge")
    _sh("ip", "-n", c.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
    _sh("ip", "-n", c.hub, "link", "set", "br0", "up")
    for i in range(nodes):
      ns, port = c.node(i), f"n{i}"
      _sh("ip", "netns", "add", ns)
      _sh("ip", "-n", ns, "link", "set", "lo", "up")
      _sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
          "netns", c.hub)
      _sh("ip", "-n", c.hub, "link", "set", port, "master", "br0", "up")
      _sh("ip", "-n", ns, "addr", "add", f"{c.address(i)}/24", "dev", "eth0")
      _sh("ip", "-n", ns, "link", "set", "eth0", "up")
      if bits is not None:
        _shape(ns, "eth0", bits)      # node -> network
        _shape(c.hub, port, bits)     # network -> node
    _write_hosts(c)
  except BaseException:
    down(c.tag)
    raise
  return c
