"""Where the ``xla`` kind's `jax.distributed` coordinator listens, chosen over MPI and checked
from every rank before JAX waits on it (docs/design/launchers.md)."""

from __future__ import annotations

import ipaddress
import os
import socket

#: Longest a rank waits for its TCP connect to the coordinator's port.
PROBE_SECONDS = 10.0


def _listen(address: str | None) -> tuple[str, socket.socket | None, str | None]:
  """Rank 0: ``(host:port, the listening socket, None)``, or ``(address, None, why not)``."""
  host, port = (address.rsplit(":", 1) if address else (socket.gethostname(), "0"))
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    listener.bind(("", int(port)))
    listener.listen(1024)
  except (OSError, ValueError) as error:
    listener.close()
    return f"{host}:{port}", None, f"cannot listen on port {port} of rank 0's host: {error}"
  return f"{host}:{listener.getsockname()[1]}", listener, None


def _resolve(host: str) -> str:
  """The first IPv4/IPv6 address of `host`, or ``"error: ..."``."""
  try:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
  except Exception as error:  # noqa: BLE001 (OSError, or UnicodeError for a bad name)
    return f"error: {error}"


def _probe(address: str, timeout: float) -> dict:
  """This rank's hostname, what it and the coordinator resolve to, and a TCP connect's result."""
  host, port = address.rsplit(":", 1)
  row = {"hostname": socket.gethostname(), "coordinator": _resolve(host)}
  row["own"] = _resolve(row["hostname"])
  try:
    with socket.create_connection((host, int(port)), timeout=timeout):
      row["connect"] = "ok"
  except Exception as error:  # noqa: BLE001 (every rank must reach the allgather)
    row["connect"] = f"error: {error}"
  return row


def _loopback(ip: str) -> bool:
  try:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback
  except ValueError:
    return False


def problems(address: str, rows: list[dict]) -> list[str]:
  """What stops `jax.distributed` (and gloo) from starting, from every rank's `_probe` row.

  Example:
    >>> ok = {"hostname": "a", "own": "10.0.0.1", "coordinator": "10.0.0.1", "connect": "ok"}
    >>> problems("a:61000", [ok, {**ok, "hostname": "b", "own": "10.0.0.2"}])
    []
    >>> gone = {**ok, "coordinator": "error: [Errno -2] Name or service not known"}
    >>> problems("a:61000", [ok, gone])[0][:70]
    "jax.distributed's coordinator a:61000 (rank 0's host) does not resolve"
  """
  host = address.rsplit(":", 1)[0]
  found = []

  def ranks(test):
    return [r for r, row in enumerate(rows) if test(row)]

  if bad := ranks(lambda row: row["coordinator"].startswith("error")):
    found.append(
        f"jax.distributed's coordinator {address} (rank 0's host) does not resolve on ranks"
        f" {bad} ({rows[bad[0]]['coordinator'][7:]}). Make every node's hostname resolve"
        " to an address the other nodes reach (DNS or /etc/hosts), or set"
        " JAX_COORDINATOR_ADDRESS=ADDRESS:PORT (rank 0's node) for the job.")
  elif bad := ranks(lambda row: row["connect"] != "ok"):
    found.append(
        f"jax.distributed's coordinator {address} (rank 0's host) resolves but does not"
        f" accept connections from ranks {bad} ({rows[bad[0]]['connect'][7:]}; resolved to"
        f" {rows[bad[0]]['coordinator']}): make {host!r} resolve to rank 0's network address"
        " on every node and let TCP through to it, or set JAX_COORDINATOR_ADDRESS.")
  if bad := ranks(lambda row: row["own"].startswith("error")):
    found.append(
        f"the hostname of ranks {bad} ({rows[bad[0]]['hostname']!r}) does not resolve"
        f" ({rows[bad[0]]['own'][7:]}): JAX's CPU collectives (gloo) bind to it. Add it to"
        " DNS or /etc/hosts with the node's network address.")
  hosts = sorted({row["hostname"] for row in rows})
  if len(hosts) > 1 and (bad := ranks(lambda row: _loopback(row["own"]))):
    found.append(
        f"the job spans {len(hosts)} hosts but the hostname of ranks {bad}"
        f" ({rows[bad[0]]['hostname']!r}) resolves to the loopback address"
        f" {rows[bad[0]]['own']}: gloo would give the other hosts an address they cannot"
        " reach, and the job would hang. Map each hostname to its network address (not"
        " 127.0.x.x) in /etc/hosts or DNS.")
  return found


def choose(mpi_comm, timeout: float) -> str:
  """The coordinator's ``host:port``, checked from every rank; else a `RuntimeError` on all.

  Example:
    >>> host, port = choose(comm.mpi_comm, 5).rsplit(":", 1)
    >>> host == comm.mpi_comm.bcast(socket.gethostname()) and int(port) > 0
    True
  """
  address, listener, refused = None, None, None
  if mpi_comm.rank == 0:
    try:
      address, listener, refused = _listen(os.environ.get("JAX_COORDINATOR_ADDRESS") or None)
    except Exception as error:  # noqa: BLE001 (the others wait in the bcast: tell them)
      refused = f"rank 0 could not choose an address: {error!r}"
  address, refused = mpi_comm.bcast((address, refused) if mpi_comm.rank == 0 else None)
  try:
    rows = mpi_comm.allgather(
        None if refused else _probe(address, min(PROBE_SECONDS, max(timeout, 1))))
  finally:
    if listener is not None:
      listener.close()
  found = [refused] if refused else problems(address, rows)
  if found:
    raise RuntimeError(
        "create_communicator('xla'): jax.distributed cannot start: " + " Also: ".join(found)
        + " (Or use kind 'hierarchical', which keeps cross-process traffic on MPI.)")
  return address
