"""MPICH's shared-memory segments that a killed job left in /dev/shm, found and removed.

MPICH's ranks on one host share a segment, ``/dev/shm/mpich_shm_*``, which it unlinks when
they finish normally. A rank killed by a test (a fault injected, a hang cut by the timeout)
leaves it behind: about 150 segments of 2-3 MB in one run of the suite, and where /dev/shm
is small the next job's ``MPI_Init`` fails with "MPIDI_POSIX_comm_bootstrap: Out of memory".
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "mpich_shm_"


def _segments_in_use() -> set[str]:
  """Names of the segments some live process has open or mapped."""
  used = set()
  for proc in Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    try:
      for line in (proc / "maps").read_text().splitlines():
        if PREFIX in line:
          used.add(line.rsplit("/", 1)[-1].split()[0])
      for fd in (proc / "fd").iterdir():
        target = os.readlink(fd)
        if PREFIX in target:
          used.add(target.rsplit("/", 1)[-1].split()[0])
    except OSError:  # the process ended meanwhile, or is not ours to read
      continue
  return used


def remove_orphaned_segments(min_age_s: float = 30.0) -> list[str]:
  """Removes the segments no live process uses that are older than `min_age_s`.

  The age keeps a job that is starting right now (its rank 0 created the segment, the
  others have not mapped it yet) out of reach. Returns the names removed.
  """
  if not SHM.is_dir():
    return []
  now = time.time()
  candidates = []
  for path in SHM.glob(PREFIX + "*"):
    try:
      if now - path.stat().st_mtime > min_age_s:
        candidates.append(path)
    except OSError:
      continue
  if not candidates:
    return []
  used = _segments_in_use()
  removed = []
  for path in candidates:
    if path.name not in used:
      try:
        path.unlink()
        removed.append(path.name)
      except OSError:
        continue
  return removed
