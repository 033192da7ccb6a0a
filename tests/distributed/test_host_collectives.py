"""Host-side collectives on the communicator (ChainerMN's ``comm.send`` ... ``allreduce_obj``):
results, the chunking above MPI's count limit, and bad input named on every rank (run in 1
process and under mpirun -n 2 and -n 3; assertions scale with comm.size)."""

import jax.numpy as jnp
import numpy as np
import pytest

from mnjax.comm._host import _transport as transport

MULTI = "needs two ranks or more (runs under mpirun)"


def test_array_collectives_move_every_rank_s_shape_and_dtype(comm):
  n, r = comm.size, comm.rank
  x = comm.bcast(np.arange(4, dtype=jnp.bfloat16) if r == 0 else None, root=0)
  assert x.dtype == jnp.bfloat16 and x.tolist() == [0, 1, 2, 3]
  mine = np.full(r + 1, r, np.int32)  # another shape on every rank
  got = comm.gather(mine, root=n - 1)
  if r == n - 1:
    assert [g.tolist() for g in got] == [[q] * (q + 1) for q in range(n)]
  else:
    assert got is None
  assert [g.tolist() for g in comm.allgather(mine)] == [[q] * (q + 1) for q in range(n)]
  parts = [np.full((j + 1, 2), 10 * r + j, np.float32) for j in range(n)]
  got = comm.alltoall(parts)
  assert [g.shape for g in got] == [(r + 1, 2)] * n
  assert [float(g[0, 0]) for g in got] == [10 * q + r for q in range(n)]
  xs = np.arange(3 * n).reshape(n, 3) if r == 0 else None
  assert comm.scatter(xs, root=0).tolist() == [3 * r, 3 * r + 1, 3 * r + 2]


def test_object_collectives(comm):
  n, r = comm.size, comm.rank
  assert comm.bcast_obj({"lr": 0.1, "r": r} if r == n - 1 else None, root=n - 1) == {
      "lr": 0.1, "r": n - 1}
  got = comm.gather_obj(("rank", r), root=0)
  assert got == ([("rank", q) for q in range(n)] if r == 0 else None)
  assert comm.allreduce_obj(r + 1) == n * (n + 1) // 2
  assert comm.allreduce_obj([r]) == list(range(n))  # rank order, on every rank


def test_point_to_point_pytrees_and_objects(comm):
  if comm.size == 1:
    pytest.skip(MULTI)
  if comm.rank == 0:
    for peer in range(1, comm.size):
      comm.send({"x": np.full((2, peer), peer, np.float32), "k": (np.int8(peer),)}, peer, tag=5)
    back = [comm.recv_obj(peer) for peer in range(1, comm.size)]
    assert back == [{"from": peer} for peer in range(1, comm.size)]
  else:
    got = comm.recv(0, tag=5)
    assert got["x"].shape == (2, comm.rank) and float(got["x"][0, 0]) == comm.rank
    assert isinstance(got["k"], tuple) and got["k"][0].dtype == np.int8
    comm.send_obj({"from": comm.rank}, 0, tag=9)


def test_payloads_above_the_message_limit_move_in_pieces(comm, monkeypatch):
  monkeypatch.setattr(transport, "MAX_MESSAGE_BYTES", 7)  # on every rank: it is compared
  cut = []
  real = transport.pieces
  monkeypatch.setattr(transport, "pieces",
                      lambda n, limit: cut.append((n, limit)) or real(n, limit))
  big = {"words": [f"w{i}" for i in range(200)]}
  assert comm.bcast_obj(big if comm.rank == 0 else None) == big
  assert comm.allreduce_obj([comm.rank] * 50) == [q for q in range(comm.size) for _ in range(50)]
  got = comm.alltoall([np.full(9, comm.rank * 100 + j, np.int64) for j in range(comm.size)])
  assert [int(g[-1]) for g in got] == [q * 100 + comm.rank for q in range(comm.size)]
  if comm.size > 1:
    assert cut and all(limit <= 7 for _, limit in cut)
    assert max(len(real(n, limit)) for n, limit in cut) > 10  # many pieces per payload
    if comm.rank == 0:
      comm.send_obj(big, 1)
    elif comm.rank == 1:
      assert comm.recv_obj(0) == big


@pytest.mark.parametrize("case", ["root out of range", "wrong number of parts", "unpicklable"])
def test_bad_input_is_the_same_error_on_every_rank(comm, case):
  with pytest.raises(ValueError) as error:
    if case == "root out of range":
      comm.bcast(np.ones(2), root=comm.size)
    elif case == "wrong number of parts":
      comm.alltoall([np.ones(2)] * (comm.size + 1))
    else:
      comm.bcast_obj(lambda: 0 if comm.rank == 0 else None, root=0)
  assert {"root out of range": f"root must be a rank in [0, {comm.size})",
          "wrong number of parts": f"{comm.size + 1} parts for {comm.size} ranks",
          "unpicklable": "does not pickle"}[case] in str(error.value)
  assert comm.allgather(np.ones(1))[0].tolist() == [1.0]  # nothing left in flight


def test_objects_that_do_not_add_up_are_named_by_rank_on_every_rank(comm):
  if comm.size == 1:
    pytest.skip(MULTI)
  last = comm.size - 1
  with pytest.raises(TypeError, match=rf"allreduce_obj: rank {last}'s object cannot be added.*"
                                      rf"rank 0: int, .*rank {last}: str"):
    comm.allreduce_obj("x" if comm.rank == last else 1)
  assert comm.allreduce_obj(1) == comm.size  # nothing left in flight


@pytest.mark.parametrize("case", ["roots", "shapes", "dtypes", "operations", "limits"])
def test_ranks_that_disagree_are_named_on_every_rank(comm, case, monkeypatch):
  if comm.size == 1:
    pytest.skip(MULTI)
  last = comm.rank == comm.size - 1
  if case == "limits" and last:  # it would cut its messages into another number of pieces
    monkeypatch.setattr(transport, "MAX_MESSAGE_BYTES", 7)
  with pytest.raises(ValueError) as error:
    if case == "roots":
      comm.bcast(np.ones(2), root=int(last))
    elif case == "shapes":
      comm.bcast(np.ones(3 if last else 2), root=0)
    elif case == "dtypes":
      comm.gather(np.ones(2, np.float32 if last else np.float64), root=0)
    elif case == "limits":
      comm.bcast_obj("x" * 100)
    elif last:
      comm.gather_obj(1)
    else:
      comm.bcast_obj(1)
  expected = {"roots": f"rank {comm.size - 1} root=1", "shapes": f"rank {comm.size - 1} passed"
              " shape (3,) float64", "dtypes": f"rank {comm.size - 1} float32",
              "operations": f"rank {comm.size - 1} in 'gather_obj'",
              "limits": f"rank {comm.size - 1} MAX_MESSAGE_BYTES=7"}[case]
  assert expected in str(error.value)


def test_point_to_point_arguments_are_checked(comm):
  with pytest.raises(ValueError, match="dest must be a rank of the communicator other than"):
    comm.send(np.ones(2), dest=comm.rank)
  with pytest.raises(ValueError, match="tag must be an int"):
    comm.send_obj(1, dest=(comm.rank + 1) % comm.size, tag=-1)
  if comm.size == 1:
    return
  if comm.rank == 0:  # the receiver calls recv for what send_obj sent: it says so, sender goes on
    comm.send_obj("text", 1, tag=3)
  elif comm.rank == 1:
    with pytest.raises(TypeError, match="sent a pickled object .send_obj. with tag 3"):
      comm.recv(0, tag=3)


def test_a_send_and_recv_that_cannot_match_end_in_a_timeout_naming_both(comm, monkeypatch):
  """Rank 0 sends with tag 1, rank 1 waits for tag 2: both waits are bounded
  (``MNJAX_WAIT_TIMEOUT``), and the receiver names the tag that did come."""
  if comm.size == 1:
    pytest.skip(MULTI)
  monkeypatch.setenv("MNJAX_WAIT_TIMEOUT", "2")
  pair = comm.split(0 if comm.rank < 2 else None)  # its own messages: nothing leaks
  if pair is None:
    return
  if pair.rank == 0:
    with pytest.raises(TimeoutError, match=r"send_obj: rank 0 waited 2 s for rank 1 to receive"
                                           r" its message \(tag 1\)"):
      pair.send_obj("x", dest=1, tag=1)
  else:
    with pytest.raises(TimeoutError, match=r"recv_obj: rank 1 waited 2 s for a message from"
                                           r" rank 0 \(tag 2\).*sent one with tag 1"):
      pair.recv_obj(source=0, tag=2)
  pair.mpi_comm.barrier()  # both waits ended on their own
  if pair.rank == 1:
    pair.mpi_comm.recv(source=0, tag=1)  # the unmatched header, taken raw (it has no payload)
