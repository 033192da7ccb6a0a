#!/usr/bin/env bash
# CI stage: the cluster launchers (issue 26), after the main suite. As root on Debian:
#   1. a real Slurm (scripts/slurm.sh up: apt-get installs slurm-wlm + munge, 2 slurmd nodes),
#      then tests/jobs/test_slurm.py (srun/PMI-2 vs mpirun, topology, sbatch + requeue,
#      scancel + --resume, --signal at once and timed, --comm xla), then scripts/slurm.sh down (also on failure);
#   2. Debian's OpenMPI (openmpi-bin, libopenmpi-dev), a venv built against it
#      (MNJAX_MPI=system MNJAX_VENV=$MNJAX_OPENMPI_VENV scripts/setup.sh), then
#      tests/jobs/test_openmpi.py (OpenMPI's mpirun -n 2 vs the mpich run).
# Each stage has a hard timeout; the times are printed at the end. Needs the main venv
# (scripts/setup.sh) for the mpich side.
#   MNJAX_OPENMPI_VENV  the OpenMPI venv (default <repo>/.venv-openmpi)
#   MNJAX_CI_OPENMPI    0 skips stage 2 (its venv builds mpi4py and mpi4jax from source:
#                       ~10 min from nothing on 2 cores, more than .ci/run's budget leaves)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export MNJAX_OPENMPI_VENV="${MNJAX_OPENMPI_VENV:-$repo/.venv-openmpi}"
py="${MNJAX_VENV:-$repo/.venv}/bin/python"
pytest=("$py" -m pytest -q -p no:cacheprovider)
times=()
stage() {  # name seconds command...
  local name="$1" limit="$2" t0=$SECONDS; shift 2
  echo "== ci_cluster_launchers: $name" >&2
  timeout --kill-after=30 "$limit" "$@"
  times+=("$name: $((SECONDS - t0)) s")
}
trap 'scripts/slurm.sh down || true; printf "ci_cluster_launchers: %s\n" "${times[@]}" >&2' EXIT

scripts/setup.sh
stage "slurm up (apt)" 300 scripts/slurm.sh up
stage "test_slurm" 900 "${pytest[@]}" tests/jobs/test_slurm.py  # 9 cases, 792 s at load 13
stage "slurm down" 60 scripts/slurm.sh down
if [ "${MNJAX_CI_OPENMPI:-1}" = 0 ]; then
  echo "ci_cluster_launchers: OpenMPI stage skipped (MNJAX_CI_OPENMPI=0)" >&2
  exit 0
fi
missing=()
for pkg in openmpi-bin libopenmpi-dev; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ "${#missing[@]}" != 0 ]; then
  stage "openmpi (apt)" 300 bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends ${missing[*]} >/dev/null"
fi
# OpenMPI's mpicc first on PATH, not the mpich wheel's (a venv's bin/ may lead PATH).
stage "openmpi venv (setup.sh)" 900 env PATH="/usr/bin:$PATH" MNJAX_MPI=system \
  MNJAX_VENV="$MNJAX_OPENMPI_VENV" scripts/setup.sh
stage "test_openmpi" 300 "${pytest[@]}" tests/jobs/test_openmpi.py
