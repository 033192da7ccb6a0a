"""The `Communicator`: rank, node, devices, and mnjax's private clones of the MPI communicator."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mpi4py import MPI

from mnjax.comm import _process_view as process_view
from mnjax.comm._host import _arrays as arrays
from mnjax.comm._host import _objects as objects
from mnjax.comm._host._split import split_group
from mnjax.comm._topology import EMULATE_NODES, node_topology

__all__ = [
    "EMULATE_NODES", "KINDS", "MULTI_DEVICE_KINDS", "Communicator", "assemble",
    "check_communicator", "node_topology",
]

#: Every communicator kind mnjax knows, with what it does (README, "Communicator kinds").
KINDS: dict[str, str] = {
    "flat": "one MPI process per device; one MPI allreduce of the fused gradient buffer",
    "hierarchical": "psum over local devices, then MPI allreduce among processes",
    "two_dimensional": "reduce-scatter over local devices, shards allreduced across nodes",
    "single_node": "every process on one node: psum over local devices, MPI among the"
                   " node's processes (none with one process)",
    "xla": "JAX-native: jax.distributed + a global mesh, psum across all devices",
}


#: Kinds that drive several local devices from one process (through `mnjax.data_parallel`).
MULTI_DEVICE_KINDS = ("hierarchical", "two_dimensional", "single_node", "xla")


@dataclasses.dataclass(frozen=True)
class Communicator:
  """The process's place in the job, and the MPI communicators mnjax uses.

  Attributes:
    kind: one of `KINDS`.
    rank, size: this process's rank and the number of processes (under the MPI kinds
      ``jax.process_index()`` stays 0 and ``jax.process_count()`` 1: read these).
    intra_rank, intra_size: rank among, and number of, the processes on this node.
    inter_rank, inter_size: index of this node among, and number of, the nodes.
    local_device_count: JAX devices this process drives (1 for ``flat``).
    axis_name: the mapped-axis name user code may reduce over (e.g. BatchNorm).
    mpi_comm: mnjax's clone of the MPI communicator for host-level collectives.
    device_comm: a second clone, for in-step collectives only (never matched with host ones).
    device_comms: multi-device kinds: one clone per local device.
    node_comms: ``flat`` on equal nodes: ``(within node, across nodes)``, for the 16-bit wire.
    devices: the local JAX devices this process drives.
    uid: a random number shared by this communicator's ranks, distinct between communicators.
    exact: gradient sums are exact integer sums (``replicas=``), whatever the process count.

  Host methods as ChainerMN's (``split``, ``send``, ``bcast``, ..., ``*_obj``) check every
  rank's arguments first and raise the same error on every rank on a mismatch.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> comm.kind, comm.rank < comm.size, comm.num_replicas % comm.size
    ('flat', True, 0)
    >>> per_rank_batch = 256 // comm.size          # e.g. of a global batch of 256
  """

  kind: str
  rank: int
  size: int
  intra_rank: int
  intra_size: int
  inter_rank: int
  inter_size: int
  local_device_count: int
  axis_name: str
  handle: int  # MPI handle of the clone: two clones are different communicators
  mpi_comm: Any = dataclasses.field(compare=False, hash=False, repr=False)
  device_comm: Any = dataclasses.field(compare=False, hash=False, repr=False)
  device_comms: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)
  node_comms: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)
  devices: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)
  uid: int = dataclasses.field(default=0, compare=False, hash=False, repr=False)
  exact: bool = False

  @property
  def num_replicas(self) -> int:
    """Model replicas in the job: processes x local devices."""
    return self.size * self.local_device_count

  @property
  def multi_device(self) -> bool:
    """True for kinds whose steps run over local devices (`mnjax.data_parallel`)."""
    return self.kind in MULTI_DEVICE_KINDS

  @property
  def mesh(self):
    """A `jax.sharding.Mesh` over ``axis_name``: this process's devices (``xla``: all)."""
    import jax  # noqa: PLC0415 (topology itself never needs JAX)
    import numpy as np  # noqa: PLC0415

    devices = jax.devices() if self.kind == "xla" else self.devices
    return jax.sharding.Mesh(np.array(devices, dtype=object), (self.axis_name,))

  @property
  def summary(self) -> str:
    """One line for a run header: ranks, nodes, devices per rank and their platform, kind."""
    platform = self.devices[0].platform if self.devices else "?"
    return (f"{self.size} rank(s) on {self.inter_size} node(s) x {self.local_device_count}"
            f" {platform} device(s), kind {self.kind}"
            + (f", {self.num_replicas} replicas, exact sums" if self.exact else ""))

  @property
  def is_root(self) -> bool:
    """True on rank 0, the rank that logs and writes files."""
    return self.rank == 0

  def split(self, color: int | None, key: int | None = None) -> Communicator | None:
    """A `Communicator` like this one over the ranks passing the same `color` (collective).

    Args:
      color: a non-negative int (equal colors form one group), or None: no group, returns None.
      key: orders the ranks within a group (default: the parent rank); an int on every rank
        or None on every rank.

    Example:
      >>> data_comm = comm.split(color=comm.rank % 2, key=comm.rank)
      >>> data_comm.size == len(range(comm.rank % 2, comm.size, 2))
      True
      >>> same = comm.split(color=0, key=-comm.rank)      # ranks in reverse order
      >>> same.rank == comm.size - 1 - comm.rank
      True
    """
    made = split_group(self, color, key)
    if made is None:
      return None
    sub, topology = made
    group = assemble(self.kind, sub, topology, self.devices, self.axis_name)
    process_view.watch_group(group)
    return group

  def send(self, x: Any, dest: int, tag: int = 0) -> None:
    """Sends a pytree of arrays to rank `dest` (any size; blocks until it is received)."""
    arrays.send(x, self, dest, tag)

  def recv(self, source: int, tag: int = 0) -> Any:
    """What rank `source` sent with `tag` (the tree, shapes and dtypes travel with it)."""
    return arrays.recv(self, source, tag)

  def bcast(self, x: Any, root: int = 0) -> Any:
    """`root`'s array on every rank (the others pass None or an array of its shape)."""
    return arrays.bcast(x, self, root)

  def gather(self, x: Any, root: int = 0) -> Any:
    """Every rank's array (shapes may differ), a tuple on `root`, None elsewhere."""
    return arrays.gather(x, self, root)

  def allgather(self, x: Any) -> Any:
    """Every rank's array, a tuple on every rank."""
    return arrays.allgather(x, self)

  def alltoall(self, xs: Any) -> Any:
    """``xs[j]`` to rank ``j``; returns the part each rank sent here."""
    return arrays.alltoall(xs, self)

  def scatter(self, xs: Any, root: int = 0) -> Any:
    """``xs[j]`` of `root` to rank ``j``."""
    return arrays.scatter(xs, self, root)

  def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
    """Sends a picklable object to rank `dest`."""
    objects.send_obj(obj, self, dest, tag)

  def recv_obj(self, source: int, tag: int | None = None) -> Any:
    """The object rank `source` sent (any tag by default)."""
    return objects.recv_obj(self, source, tag)

  def bcast_obj(self, obj: Any, root: int = 0) -> Any:
    """`root`'s object on every rank.

    Example:
      >>> comm.bcast_obj({"epoch": 3}, root=0)
      {'epoch': 3}
    """
    return objects.bcast_obj(obj, self, root)

  def gather_obj(self, obj: Any, root: int = 0) -> list | None:
    """Every rank's object, in a list on `root` (None elsewhere)."""
    return objects.gather_obj(obj, self, root)

  def allreduce_obj(self, obj: Any) -> Any:
    """The sum (``+``) of every rank's object, on every rank."""
    return objects.allreduce_obj(obj, self)


def check_communicator(comm: Any, caller: str) -> Communicator:
  """Raises a `TypeError` saying how to build one unless `comm` is a `Communicator`.

  Example:
    >>> check_communicator(None, "allreduce_gradients")
    Traceback (most recent call last):
    ...
    TypeError: allreduce_gradients needs an mnjax Communicator as its `comm`, got NoneType ...
  """
  if not isinstance(comm, Communicator):
    raise TypeError(
        f"{caller} needs an mnjax Communicator as its `comm`, got {type(comm).__name__}"
        f" ({comm!r}). Build one once per process, on every rank:"
        " `comm = mnjax.create_communicator('flat')`, and pass it where"
        f" {caller}'s signature names `comm` (help({caller.rsplit('.', 1)[-1]}))."
    )
  return comm


def assemble(kind: str, clone: MPI.Intracomm, topology: tuple[int, int, int, int],
             devices: tuple, axis_name: str, exact: bool = False) -> Communicator:
  """The `Communicator` over `clone` (which it then owns), with its in-step clones (collective).

  Example:
    >>> sub = assemble("flat", comm.mpi_comm.Clone(), (0, 1, 0, 1), comm.devices, "batch")
    >>> sub.size == comm.size and sub != comm     # another MPI communicator
    True
  """
  intra_rank, intra_size, inter_rank, inter_size = topology
  node_comms = ()
  if kind == "flat" and clone.size > 1:  # every rank decides alike: one allgather
    sizes = set(clone.allgather(intra_size))
    if len(sizes) == 1 and 1 < intra_size < clone.size:
      node_comms = (clone.Split(inter_rank, intra_rank), clone.Split(intra_rank, inter_rank))
  uid = clone.bcast(int.from_bytes(os.urandom(8), "little") if clone.rank == 0 else None)
  return Communicator(
      kind=kind,
      rank=clone.rank,
      size=clone.size,
      intra_rank=intra_rank,
      intra_size=intra_size,
      inter_rank=inter_rank,
      inter_size=inter_size,
      local_device_count=len(devices),
      axis_name=axis_name,
      handle=int(clone.py2f()),
      mpi_comm=clone,
      device_comm=clone.Clone(),
      device_comms=tuple(clone.Clone() for _ in devices) if kind in MULTI_DEVICE_KINDS else (),
      node_comms=node_comms,
      devices=devices,
      uid=uid,
      exact=exact,
  )

