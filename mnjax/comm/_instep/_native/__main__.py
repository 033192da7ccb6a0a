"""``python -m mnjax.comm._instep._native [--force]``: compile the in-place allreduce handler."""

import sys

from mnjax.comm._instep import _native as native

if __name__ == "__main__":
  path = native.build(force="--force" in sys.argv[1:])
  print(f"mnjax.comm._instep._native: {path}")
