"""``python -m mnjax.comm._instep._native [--force]``: compile the in-place allreduce handler."""

import sys

from mnjax.comm._instep._native._build import build

if __name__ == "__main__":
  path = build(force="--force" in sys.argv[1:])
  print(f"mnjax.comm._instep._native: {path}")
