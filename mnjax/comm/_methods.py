"""ChainerMN's communicator methods on `Communicator`: ``comm.split``, ``comm.send``, ...

A ChainerMN user looks for these on the communicator (``comm.bcast_obj(x)``,
``comm.split(color, key)``). They are implemented in `mnjax.collectives` (a layer above this
one: they build on the tree checks of `mnjax.comm._host`), as functions that take the
communicator (``mnjax.collectives.bcast_obj(x, comm)``, like `mnjax.broadcast`). The methods
here only delegate, importing that package when called, so that `mnjax.comm` never imports
an upper layer when it is imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CommunicatorMethods"]


def _impl():
  from mnjax import collectives  # noqa: PLC0415 (an upper layer: imported when called)

  return collectives


class CommunicatorMethods:
  """The methods; each is ``mnjax.collectives.<name>`` with this communicator.

  Example:
    >>> comm.bcast_obj({"epoch": 3}, root=0)
    {'epoch': 3}
  """

  __slots__ = ()

  def split(self, color: int | None, key: int | None = None) -> Any:
    """`mnjax.collectives.split`: the communicator of the ranks with this `color`."""
    return _impl().split(self, color, key)

  def send(self, x: Any, dest: int, tag: int = 0) -> None:
    """`mnjax.collectives.send`: a pytree of arrays to rank `dest`."""
    return _impl().send(x, self, dest, tag)

  def recv(self, source: int, tag: int = 0) -> Any:
    """`mnjax.collectives.recv`: what rank `source` sent with `tag`."""
    return _impl().recv(self, source, tag)

  def bcast(self, x: Any, root: int = 0) -> Any:
    """`mnjax.collectives.bcast`: `root`'s array on every rank."""
    return _impl().bcast(x, self, root)

  def gather(self, x: Any, root: int = 0) -> Any:
    """`mnjax.collectives.gather`: every rank's array, on `root`."""
    return _impl().gather(x, self, root)

  def allgather(self, x: Any) -> Any:
    """`mnjax.collectives.allgather`: every rank's array, on every rank."""
    return _impl().allgather(x, self)

  def alltoall(self, xs: Any) -> Any:
    """`mnjax.collectives.alltoall`: ``xs[j]`` to rank ``j``, one array from each rank."""
    return _impl().alltoall(xs, self)

  def scatter(self, xs: Any, root: int = 0) -> Any:
    """`mnjax.collectives.scatter`: ``xs[j]`` of `root` to rank ``j``."""
    return _impl().scatter(xs, self, root)

  def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
    """`mnjax.collectives.send_obj`: a picklable object to rank `dest`."""
    return _impl().send_obj(obj, self, dest, tag)

  def recv_obj(self, source: int, tag: int | None = None) -> Any:
    """`mnjax.collectives.recv_obj`: the object rank `source` sent (any tag by default)."""
    return _impl().recv_obj(self, source, tag)

  def bcast_obj(self, obj: Any, root: int = 0) -> Any:
    """`mnjax.collectives.bcast_obj`: `root`'s object on every rank."""
    return _impl().bcast_obj(obj, self, root)

  def gather_obj(self, obj: Any, root: int = 0) -> Any:
    """`mnjax.collectives.gather_obj`: every rank's object, in a list on `root`."""
    return _impl().gather_obj(obj, self, root)

  def allreduce_obj(self, obj: Any) -> Any:
    """`mnjax.collectives.allreduce_obj`: the sum (``+``) of every rank's object."""
    return _impl().allreduce_obj(obj, self)
