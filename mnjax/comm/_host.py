"""Host-level broadcast of a pytree (initial parameters, optimizer state), outside any trace.

It uses mpi4py on numpy buffers, fused per dtype, after checking on every rank that all
ranks passed the same tree structure, shapes and dtypes — a mismatch raises everywhere
instead of corrupting memory or hanging. Host traffic runs on ``comm.mpi_comm``, never on
the in-step communicators (see `mnjax.comm._primitives`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from mnjax.comm._collectives import group_by_dtype
from mnjax.comm._communicator import Communicator, check_communicator

__all__ = ["broadcast"]


def _signature(tree: Any, arrays: list[np.ndarray]) -> tuple:
  """(leaf path, shape, dtype) per leaf: what must agree across ranks before a transfer."""
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return tuple((p, a.shape, a.dtype.str) for p, a in zip(paths, arrays))


def broadcast(tree: Any, comm: Communicator, root: int = 0) -> Any:
  """Returns `root`'s copy of `tree` on every rank (host-level; call outside `jax.jit`).

  Use it once at start-up so every replica begins from identical parameters and optimizer
  state. Every rank passes a tree of the same structure, shapes and dtypes (e.g. parameters
  initialised from any seed); otherwise a `ValueError` naming the first difference is raised
  on every rank and nothing is transferred.

  Args:
    tree: pytree of arrays (jax or numpy) or scalars.
    comm: the `Communicator`.
    root: the rank whose values everyone receives.

  Returns:
    A pytree like `tree`; jax arrays come back as jax arrays, everything else as numpy.

  Example:
    >>> comm = mnjax.create_communicator("flat")
    >>> params = model.init(jax.random.key(comm.rank), x)   # different on every rank...
    >>> params = mnjax.broadcast(params, comm, root=0)      # ...now identical
  """
  check_communicator(comm, "broadcast")
  if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
    raise ValueError(
        f"broadcast: root must be a rank in [0, {comm.size}), got {root!r}; pass root=0"
        " to broadcast from the first rank."
    )
  if comm.size == 1:
    return tree
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [np.asarray(leaf) for leaf in leaves]
  mpi = comm.mpi_comm

  mine = _signature(tree, arrays)
  theirs = mpi.bcast(mine, root=root)
  mismatch = mpi.allreduce(int(mine != theirs), op=MPI.MAX)
  if mismatch:
    raise ValueError(_describe_mismatch(mpi, mine, root))

  out: list[Any] = list(arrays)
  # Host transfers move raw bytes, so every numpy dtype travels as itself.
  for group in group_by_dtype([a.dtype for a in arrays], key=lambda dtype: dtype):
    buf = (
        np.concatenate([arrays[i].ravel() for i in group.positions])
        if comm.rank == root
        else np.empty(sum(arrays[i].size for i in group.positions), group.dtype)
    )
    mpi.Bcast(buf.view(np.uint8), root=root)  # raw bytes: also bfloat16, bool, ...
    offset = 0
    for i in group.positions:
      out[i] = buf[offset:offset + arrays[i].size].reshape(arrays[i].shape)
      offset += arrays[i].size
  out = [jnp.asarray(o) if isinstance(leaf, jax.Array) else o for o, leaf in zip(out, leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def _describe_mismatch(mpi: MPI.Intracomm, mine: tuple, root: int) -> str:
  """The same message on every rank: which ranks differ from the root, at which leaf."""
  everyone = mpi.allgather(mine)
  ref = everyone[root]
  details = []
  for rank, sig in enumerate(everyone):
    if sig == ref:
      continue
    if len(sig) != len(ref):
      details.append(f"rank {rank} has {len(sig)} leaves, rank {root} has {len(ref)}")
    diff = next(((s, r) for s, r in zip(sig, ref) if s != r), None)
    if diff is not None:
      (path, shape, dtype), (rpath, rshape, rdtype) = diff
      details.append(
          f"rank {rank} leaf {path} {shape} {dtype} vs rank {root} leaf {rpath}"
          f" {rshape} {rdtype}"
      )
  return (
      "broadcast: every rank must pass a tree with the same structure, shapes and dtypes"
      f" as root rank {root}; differences: " + "; ".join(details) + ". Build the tree the"
      " same way on every rank (the same model and input shapes) before broadcasting."
  )
