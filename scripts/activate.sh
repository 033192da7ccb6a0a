# Sourced by the entry points: set up (or reuse) the venv, put it first on PATH, cd to the repo.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
venv="${MNJAX_VENV:-$repo/.venv}"
export PATH="$venv/bin:$PATH"
# mpi4jax on GPUs: the mpich wheel is not CUDA-aware, so GPU buffers are copied through host
# memory around each MPI call (mnjax.comm._cuda_mpi). With MNJAX_MPI=system, set
# MPI4JAX_USE_CUDA_MPI=1 for a CUDA-aware cluster MPI, or 0.
if [ "$(cat "$venv/.mnjax-mpi" 2>/dev/null)" = mpich ]; then
  export MPI4JAX_USE_CUDA_MPI="${MPI4JAX_USE_CUDA_MPI:-0}"
fi
cd "$repo"

