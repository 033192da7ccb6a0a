# Sourced by the entry points: set up (or reuse) the venv, put it first on PATH, cd to the repo.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
venv="${MNJAX_VENV:-$repo/.venv}"
export PATH="$venv/bin:$PATH"
cd "$repo"

