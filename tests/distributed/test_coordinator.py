"""The ``xla`` kind's jax.distributed coordinator (mnjax/comm/_coordinator.py): chosen over MPI
on rank 0's host and a free port, checked from every rank before JAX would wait on it; a
name that resolves nowhere or a port nobody listens on is one error on every rank, not a
timeout and a SIGABRT (what an emulated node's hostname gave before)."""

import socket

import pytest

from mnjax.comm import _coordinator as coordinator


def test_every_rank_gets_rank_0s_host_and_a_port_it_reached(comm):
  address = coordinator.choose(comm.mpi_comm, 5)
  host, port = address.rsplit(":", 1)
  assert comm.mpi_comm.allgather(address) == [address] * comm.size
  assert host == comm.mpi_comm.bcast(socket.gethostname()) and 0 < int(port) < 65536
  # the probe's port is closed again: jax.distributed binds it next
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", int(port)))


@pytest.mark.parametrize("address,message", [
    ("mnjax-no-such-host.invalid:61000", "does not resolve on ranks {all}"),
    ("localhost:0x", "cannot listen on port 0x"),
])
def test_a_coordinator_nobody_reaches_is_one_error_on_every_rank(comm, monkeypatch, address,
                                                                 message):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", address)
  with pytest.raises(RuntimeError) as raised:
    coordinator.choose(comm.mpi_comm, 5)
  text = str(raised.value)
  assert message.format(all=list(range(comm.size))) in text, text
  assert comm.mpi_comm.allgather(text) == [text] * comm.size


def test_a_loopback_hostname_across_hosts_is_named():
  row = {"hostname": "a", "own": "127.0.1.1", "coordinator": "10.0.0.1", "connect": "ok"}
  found = coordinator.problems("a:1", [row, {**row, "hostname": "b"}])
  assert len(found) == 1 and "loopback address 127.0.1.1" in found[0], found
  assert coordinator.problems("a:1", [row, row]) == []   # one host: loopback is right
  refused = {**row, "connect": "error: [Errno 111] Connection refused"}
  found = coordinator.problems("a:1", [row, refused])
  assert "does not accept connections from ranks [1]" in found[0], found
