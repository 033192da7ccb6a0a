#!/usr/bin/env bash
# The whole test suite: unit tests, the distributed tests in one process and (launched from
# pytest, each under a timeout) under `mpirun -n 2` and `-n 3`, then the end-to-end jobs.
#   scripts/test.sh                              # everything (~30 min on 2 cores)
#   scripts/test.sh -m "not slow and not mpirun" # the fast subset (docs/testing.md)
#   scripts/test.sh -k scatter                   # pytest arguments pass through
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate.sh"
exec "$venv/bin/python" -m pytest "$@"
