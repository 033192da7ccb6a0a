"""``python -m mnjax.native [--force]``: compile the in-place allreduce handler."""

import sys

from mnjax import native

if __name__ == "__main__":
  path = native.build(force="--force" in sys.argv[1:])
  print(f"mnjax.native: {path}")
