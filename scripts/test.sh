#!/usr/bin/env bash
# The whole test suite: single-process tests, then the same distributed tests under
# `mpirun -n 2` and `-n 3` (launched from pytest, each under a timeout).
#   scripts/test.sh            # everything
#   scripts/test.sh -k scatter # pytest arguments pass through
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate.sh"
exec "$venv/bin/python" -m pytest "$@"
