# Sourced by the entry points: set up (or reuse) the venv, put it first on PATH, cd to the repo.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
venv="${MNJAX_VENV:-$repo/.venv}"
export PATH="$venv/bin:$PATH"
cd "$repo"

# glibc malloc for XLA:CPU (python -m mnjax.bench allreduce measures the difference): by
# default every buffer above 32 MB is a fresh mmap, so each call of a step page-faults on
# its large buffers (a 102 MB elementwise op: ~40 ms instead of ~10 ms), and XLA's worker
# threads get arenas whose heaps cannot hold such buffers at all. One arena, no mmap below
# 1 GiB and no trimming keep large buffers in the heap and reuse them. Already-set values win.
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-1}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1073741824}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-4294967296}"
