#!/usr/bin/env bash
# The whole test suite: unit tests, the distributed tests in one process and (launched from
# pytest, each under a timeout) under `mpirun -n 2` and `-n 3`, then the end-to-end jobs.
# Two pytest workers where there are 2 cores or more (pytest-xdist, a test file each at a
# time, the longest job files first: tests/conftest.py); MNJAX_TEST_WORKERS=0 runs one test
# at a time, =N runs N workers.
#   scripts/test.sh                              # everything
#   scripts/test.sh -m "not slow and not mpirun" # the fast subset (docs/testing.md)
#   scripts/test.sh -k scatter                   # pytest arguments pass through
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate.sh"
workers="${MNJAX_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}"
if [[ "$workers" == 0 ]]; then
  exec "$venv/bin/python" -m pytest "$@"
fi
exec "$venv/bin/python" -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
