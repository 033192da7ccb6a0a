#!/usr/bin/env bash
# CI stages: the cluster launchers (issue 26), after the main suite. As root on Debian:
#
#   scripts/ci_cluster_launchers.sh slurm     # a real Slurm (scripts/slurm.sh up: apt-get
#       # installs slurm-wlm + munge, 2 slurmd nodes), tests/jobs/test_slurm.py (srun/PMI-2
#       # vs mpirun for train.py and imagenet.py, topology, bad launches, sbatch + requeue,
#       # scancel + --resume, --signal at once and timed, --comm xla), then
#       # scripts/slurm.sh down (also on failure)
#   scripts/ci_cluster_launchers.sh prepare   # Debian's OpenMPI (openmpi-bin,
#       # libopenmpi-dev) and a venv built against it (MNJAX_MPI=system
#       # MNJAX_VENV=$MNJAX_OPENMPI_VENV scripts/setup.sh); idempotent, no tests. .ci/run
#       # starts it in the background during the main suite (niced, -O0: see below)
#   scripts/ci_cluster_launchers.sh openmpi   # prepare (instant when done), then
#       # tests/jobs/test_openmpi.py (OpenMPI's mpirun -n 2: the main job vs mpich, a subset
#       # of tests/distributed, abort / watchdog / departures, launchers of the other MPI)
#   scripts/ci_cluster_launchers.sh           # slurm, then openmpi
#
# Each stage has a hard timeout; the times are printed at the end. Needs the main venv
# (scripts/setup.sh) for the mpich side.
#   MNJAX_OPENMPI_VENV    the OpenMPI venv (default <repo>/.venv-openmpi)
#   MNJAX_OPENMPI_CFLAGS  CFLAGS for building mpi4py and mpi4jax from source (default: none,
#                         i.e. their -O2). .ci/run passes -O0: mpi4py's one generated C file
#                         then compiles in 21 s of CPU instead of 137 s; only the Cython
#                         wrappers lose optimisation (Debian's libmpi, which does the work,
#                         and mnjax's own handlers are built as usual), no result changes
#   MNJAX_OPENMPI_PREPARE_LIMIT  seconds the OpenMPI venv's set-up may take (default 900;
#                         .ci/run allows more: its set-up runs niced beside the main suite,
#                         which keeps both cores busy, so it mostly waits for the suite's end)
#   MNJAX_CI_OPENMPI      0: the default command skips the OpenMPI stage
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export MNJAX_OPENMPI_VENV="${MNJAX_OPENMPI_VENV:-$repo/.venv-openmpi}"
py="${MNJAX_VENV:-$repo/.venv}/bin/python"
pytest=("$py" -m pytest -q -p no:cacheprovider --durations=8)
times=()
stage() {  # name seconds command...
  local name="$1" limit="$2" t0=$SECONDS; shift 2
  echo "== ci_cluster_launchers: $name" >&2
  local rc=0
  timeout --kill-after=30 "$limit" "$@" || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "ci_cluster_launchers: $name ran past its $limit s limit and was stopped" >&2
  fi
  [ "$rc" = 0 ] || exit "$rc"
  times+=("$name: $((SECONDS - t0)) s")
}
report() { [ "${#times[@]}" = 0 ] || printf "ci_cluster_launchers: %s\n" "${times[@]}" >&2; }

slurm_stage() {
  trap 'scripts/slurm.sh down || true; report' EXIT
  stage "slurm up (apt)" 300 scripts/slurm.sh up
  stage "test_slurm" 900 "${pytest[@]}" tests/jobs/test_slurm.py
  stage "slurm down" 60 scripts/slurm.sh down
  trap report EXIT
}

prepare() {
  local missing=() pkg
  for pkg in openmpi-bin libopenmpi-dev; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ "${#missing[@]}" != 0 ]; then
    # DPkg::Lock::Timeout: scripts/slurm.sh may be installing at the same time.
    stage "openmpi (apt)" 300 bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=120 \
      ${missing[*]} >/dev/null"
  fi
  # OpenMPI's mpicc first on PATH, not the mpich wheel's (a venv's bin/ may lead PATH).
  stage "openmpi venv (setup.sh)" "${MNJAX_OPENMPI_PREPARE_LIMIT:-900}" env PATH="/usr/bin:$PATH" MNJAX_MPI=system \
    MNJAX_VENV="$MNJAX_OPENMPI_VENV" CFLAGS="${MNJAX_OPENMPI_CFLAGS:-${CFLAGS:-}}" \
    scripts/setup.sh
}

openmpi_stage() {
  prepare
  stage "test_openmpi" 600 "${pytest[@]}" tests/jobs/test_openmpi.py
}

scripts/setup.sh
trap report EXIT
case "${1:-all}" in
  slurm) slurm_stage ;;
  prepare) prepare ;;
  openmpi) openmpi_stage ;;
  all)
    slurm_stage
    if [ "${MNJAX_CI_OPENMPI:-1}" = 0 ]; then
      echo "ci_cluster_launchers: OpenMPI stage skipped (MNJAX_CI_OPENMPI=0)" >&2
    else
      openmpi_stage
    fi ;;
  *) echo "usage: scripts/ci_cluster_launchers.sh [slurm|prepare|openmpi]" >&2; exit 2 ;;
esac
