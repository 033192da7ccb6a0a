"""Pre-flight, at trace time: are all ranks about to exchange the same thing?

MPI only sees bytes: a ``(64, 10)`` and a ``(10, 64)`` leaf sum silently, an extra leaf hangs.
`check_same_on_all_ranks` compares signatures, `check_collective_sequence` the in-step
collectives (docs/design/failures.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mnjax.comm._communicator import Communicator
from mnjax.comm._host._agreement import gather_if_different, group_note
from mnjax.comm._host._signature import tree_signature
from mnjax.comm._instep._sequence import note_collective, recording
from mnjax.guard import _pairing as pairing

__all__ = [
    "DEFAULT_TIMEOUT", "check_collective_sequence", "check_same_on_all_ranks",
    "note_collective", "recording", "tree_signature",
]

#: Seconds a rank waits for the others to reach the same check (the slowest start-up).
DEFAULT_TIMEOUT = 600.0


def check_same_on_all_ranks(comm: Communicator, what: str, signature: Any, *,
                            caller: str, timeout: float = DEFAULT_TIMEOUT) -> None:
  """Raises on every rank unless every rank passed an equal `signature`.

  Collective over ``comm.mpi_comm`` (host level): one allgather of a 16-byte hash; the full
  signatures travel only on a mismatch.

  Args:
    what: what is compared, for the message (e.g. ``"the gradient tree"``).
    signature: ``{"options": {...}, "tree": tree_signature(...)}`` or any picklable value
      whose ``repr`` is deterministic.
    caller: the public function on whose behalf the check runs.
    timeout: seconds to wait for the other ranks; then a `TimeoutError` names the check.

  Example:
    >>> g = {"w": jnp.zeros(3)}
    >>> check_same_on_all_ranks(comm, "the gradient tree", {"tree": tree_signature(g)},
    ...                         caller="allreduce_gradients")
  """
  signatures = gather_if_different(
      comm, f"{caller}'s pre-flight check", signature, what=f"{caller}'s check of {what}",
      timeout=timeout, timeout_message=(
          f"{caller}: rank {comm.rank} waited {timeout:.0f} s for the other ranks to check"
          f" {what} before the first exchange, and not all of them came. Every rank must"
          " trace the step (call it with the same shapes, in the same order); a step"
          " traced on some ranks only (e.g. jax.eval_shape on rank 0) cannot exchange"
          " anything. Raise the timeout if start-up is slower than this."))
  if signatures is not None:
    raise ValueError(describe_mismatch(signatures, what, caller) + group_note(comm.mpi_comm))


def describe_mismatch(signatures: list[Any], what: str, caller: str) -> str:
  """The message for ranks whose signature differs from rank 0's (same text on every rank)."""
  ref = signatures[0]
  details = []
  for rank, sig in enumerate(signatures[1:], start=1):
    if sig == ref:
      continue
    details.extend(f"rank {rank} vs rank 0: {d}" for d in _differences(sig, ref))
  return (
      f"{caller}: the ranks disagree on {what}, so their exchange would mix unrelated"
      f" values (MPI sums equal byte counts without checking). {'; '.join(details)}."
      " Build the model, the loss and the optimizer identically on every rank, and feed"
      " every rank batches of the same shape; nothing was exchanged."
  )


def _differences(sig: Any, ref: Any) -> list[str]:
  if not (isinstance(sig, dict) and isinstance(ref, dict)):
    return [f"{sig!r} != {ref!r}"]
  out = []
  for key in sorted(set(sig) | set(ref)):
    a, b = sig.get(key), ref.get(key)
    if a == b:
      continue
    if isinstance(a, tuple) and isinstance(b, tuple) and key.endswith("tree"):
      out.extend(_tree_differences(a, b))
    else:
      out.append(f"{key} is {a!r} vs {b!r}")
  return out


def _tree_differences(tree: tuple, ref: tuple) -> list[str]:
  """Leaf by leaf, by path: different shape or dtype, missing or extra leaves, order."""
  mine = {path: (shape, dtype) for path, shape, dtype in tree}
  theirs = {path: (shape, dtype) for path, shape, dtype in ref}
  out = []
  for path, (shape, dtype) in mine.items():
    if path not in theirs:
      out.append(f"leaf {path} {dtype}{list(shape)} exists only on this rank")
      continue
    rshape, rdtype = theirs[path]
    if (shape, dtype) != (rshape, rdtype):
      same_size = int(np.prod(shape)) == int(np.prod(rshape)) and shape != rshape
      out.append(
          f"leaf {path} is {dtype}{list(shape)} vs {rdtype}{list(rshape)}"
          + (" (same element count: MPI would have summed them silently)" if same_size
             else ""))
  out.extend(f"leaf {path} {rdtype}{list(rshape)} is missing"
             for path, (rshape, rdtype) in theirs.items() if path not in mine)
  if not out:
    out.append("the same leaves in a different order")
  return out


_COLLECTIVES_LATE = (
    "Every rank must run the same layers (a rank without any SyncBatchNorm layer in its"
    " step, or one that does not call the step, leaves the others waiting).")
_EXCHANGES_LATE = (
    "Every rank of the communicator must trace the step (a rank with nothing to exchange"
    " too), the same step functions in the same order.")


def check_collective_sequence(comm: Communicator, sequence: Any, *, caller: str,
                              agreed: set | None = None,
                              timeout: float = DEFAULT_TIMEOUT) -> None:
  """Raises `ValueError` on every rank unless every rank traced the same in-step collectives
  (`recording`) in the same order, with the same shapes and dtypes (`mnjax.functions`
  exchanges must pair up instead). Collective unless `sequence` is in `agreed` (where it goes
  once agreed); a rank that never comes is a `TimeoutError` after `timeout` s.

  Example:
    >>> check_collective_sequence(comm, [("SyncBatchNorm layer BatchNorm_0", (3, 16),
    ...                                   "float32")], caller="data_parallel")
  """
  sequence = tuple(sequence)
  agreed = set() if agreed is None else agreed
  if sequence in agreed:
    return
  if comm.size == 1:
    if pairing.involved([sequence]):  # mnjax.functions' exchanges: pair them (`_pairing`)
      pairing.check_exchanges([sequence], comm.mpi_comm, caller=caller)
    return
  everyone = gather_if_different(
      comm, "the step's check of its in-step collectives", sequence,
      what=f"{caller}'s check of the step's in-step collectives",
      timeout=timeout, timeout_message=(
          f"{caller}: rank {comm.rank} waited {timeout:.0f} s for the other ranks to check"
          f" the {len(sequence)} in-step collective(s) of its step (the first:"
          f" {_entry(sequence, 0)}), and not all of them came. "
          + (_EXCHANGES_LATE if pairing.involved([sequence]) else _COLLECTIVES_LATE)))
  if everyone is None and pairing.has_refusal(sequence):  # refused alike on every rank
    raise pairing.refusal_error(sequence, caller=caller)
  if everyone is not None and pairing.involved(everyone):  # a model-parallel step
    pairing.check_exchanges(everyone, comm.mpi_comm, caller=caller)
  elif everyone is not None:
    raise ValueError(describe_sequences(everyone, caller) + group_note(comm.mpi_comm))
  agreed.add(sequence)


def describe_sequences(everyone: list[tuple], caller: str) -> str:
  """The message for ranks whose collective sequence differs from rank 0's.

  Example:
    >>> a = (("SyncBatchNorm layer BatchNorm_0", (3, 4), "float32"),)
    >>> describe_sequences([a, a + a], "data_parallel")[:60]
    'data_parallel: the ranks traced different in-step collective'
  """
  ref = everyone[0]
  details = []
  for rank, seq in enumerate(everyone):
    if seq == ref:
      continue
    i = next((i for i, (a, b) in enumerate(zip(seq, ref)) if a != b), min(len(seq), len(ref)))
    details.append(
        f"rank {rank} traced {len(seq)} collective(s), rank 0 {len(ref)}; the first difference is"
        f" collective {i + 1}: rank {rank} {_entry(seq, i)}, rank 0 {_entry(ref, i)}")
  return (
      f"{caller}: the ranks traced different in-step collectives, so the step would wait"
      " forever for a collective some rank never issues, or MPI would mix unrelated"
      f" buffers. {'; '.join(details)}. Build the same model on every rank (the same"
      " SyncBatchNorm layers with the same feature widths, called in the same order);"
      " nothing was exchanged.")


def _entry(sequence: tuple, i: int) -> str:
  if i >= len(sequence):
    return "nothing (its step ends there)"
  what, shape, dtype = sequence[i]
  return f"{what} ({dtype}{list(shape)})"
