"""Compiling `mpi_collectives.cc` into the handlers' library (at set-up, or when it is stale)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from jax import ffi

from mnjax.comm._instep._native import LIBRARY, SOURCE, is_stale

__all__ = ["build"]


def _compiler() -> str:
  candidates = [os.environ.get("MPICXX"), str(Path(sys.executable).with_name("mpicxx")),
                shutil.which("mpicxx"), shutil.which("mpic++")]
  for c in candidates:
    if c and Path(c).is_file() and os.access(c, os.X_OK):
      return c
  raise FileNotFoundError(
      "mnjax.comm._instep._native: no MPI C++ compiler found (looked at $MPICXX, mpicxx next to"
      f" {sys.executable}, mpicxx/mpic++ on PATH). Install the `mpich` extra or put your"
      " MPI's mpicxx on PATH (or set MPICXX=/path/to/mpicxx), then run"
      " `python -m mnjax.comm._instep._native`."
  )


def build(force: bool = False) -> Path:
  """Compiles the handler into `LIBRARY` (skipped when up to date unless `force`).

  Example:
    >>> mnjax.comm._instep._native._build.build()
    PosixPath('.../mnjax/comm/_instep/_native/_mpi_collectives.so')
  """
  if not force and not is_stale():
    return LIBRARY
  tmp = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
  cmd = [_compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{ffi.include_dir()}",
         str(SOURCE), "-o", str(tmp)]
  out = subprocess.run(cmd, capture_output=True, text=True)
  if out.returncode != 0:
    tmp.unlink(missing_ok=True)
    raise RuntimeError(
        f"mnjax.comm._instep._native: `{' '.join(cmd)}` failed:\n{out.stderr[-4000:]}")
  tmp.replace(LIBRARY)  # atomic: a concurrent loader never sees half a library
  return LIBRARY
