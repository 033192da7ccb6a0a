#!/usr/bin/env bash
# The whole test suite: single-process tests, then the same distributed tests under
# `mpirun -n 2` and `-n 3` (launched from pytest, each under a timeout).
#   scripts/test.sh            # everything
#   scripts/test.sh -k scatter # pytest arguments pass through
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
venv="${MNJAX_VENV:-$repo/.venv}"
export PATH="$venv/bin:$PATH"
cd "$repo"
exec "$venv/bin/python" -m pytest "$@"
