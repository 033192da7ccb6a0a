#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything mnjax needs.
#
#   scripts/setup.sh                 # .venv with MPICH from the `mpich` wheel (one machine)
#   MNJAX_MPI=system scripts/setup.sh  # use the cluster's MPI (its mpicc must be on PATH)
#   MNJAX_EXTRAS=cuda scripts/setup.sh # also jaxlib's CUDA plugin, and mpi4jax's CUDA extension
#                                      # (rebuilt if a CPU-only build is installed); checked
#   MNJAX_EXTRAS=cuda MNJAX_VENV=.venv-cuda scripts/setup.sh  # a second venv for the
#                                      # deviceless GPU compiles (tests/aot, bench aot):
#                                      # works without a GPU and without a CUDA toolkit
#
# Environment:
#   MNJAX_VENV    where the venv lives (default: <repo>/.venv)
#   PYTHON        interpreter to build it from (default: python3.11, else python3 >= 3.11)
#   MNJAX_MPI     "mpich" (default: the PyPI wheel) or "system"
#   MNJAX_EXTRAS  extra pip extras, comma-separated (e.g. "cuda")
#
# Idempotent: a stamp of the inputs (this file, pyproject.toml, the options) skips the
# install when nothing changed. Safe to call from every entry point.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MNJAX_VENV:-$repo/.venv}"
mpi_kind="${MNJAX_MPI:-mpich}"
extras="${MNJAX_EXTRAS:-}"

case "$mpi_kind" in
  mpich|system) ;;
  *) echo "setup.sh: MNJAX_MPI must be 'mpich' or 'system', got '$mpi_kind'" >&2; exit 2 ;;
esac

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for p in python3.11 python3; do
    if command -v "$p" >/dev/null 2>&1; then echo "$p"; return; fi
  done
  echo "setup.sh: no python3 found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
  exit 2
}

stamp_inputs() {
  cat "$repo/pyproject.toml" "$repo/scripts/setup.sh"
  echo "mpi=$mpi_kind extras=$extras"
}
stamp="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
if [ -f "$venv/.mnjax-stamp" ] && [ "$(cat "$venv/.mnjax-stamp")" = "$stamp" ]; then
  exit 0
fi

py="$(pick_python)"
"$py" - <<'EOF' || { echo "setup.sh: mnjax needs Python >= 3.11 (set PYTHON=...)" >&2; exit 2; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
EOF

echo "setup.sh: preparing $venv (MPI: $mpi_kind)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip "setuptools>=68" wheel

# mpi4jax compiles against jax's FFI headers and an MPI compiler. Build it without
# isolation, against exactly the jax release this project pins, with mpi4py and nanobind
# already present.
jax_pin="$(sed -n 's/^ *"jax==\([^"]*\)",.*/\1/p' "$repo/pyproject.toml")"
mpi4jax_pin="$(sed -n 's/^ *"mpi4jax==\([^"]*\)",.*/\1/p' "$repo/pyproject.toml")"
if [ "$mpi_kind" = mpich ]; then
  "${pip[@]}" install "mpich>=4.2" "mpi4py>=4.0"
  export PATH="$venv/bin:$PATH"  # the wheel's mpicc / mpirun
else
  command -v mpicc >/dev/null || { echo "setup.sh: MNJAX_MPI=system needs mpicc on PATH (module load mpi?)" >&2; exit 2; }
  # mpi4py and mpi4jax built from source with the cluster's mpicc, never from pip's cache
  # (a wheel built earlier against another MPI: mpi4jax then refuses, "MPI ABI
  # incompatibility"); mnjax/comm/_instep/_native keeps one library per MPI vendor.
  export MPICC="$(command -v mpicc)" MPI4JAX_BUILD_MPICC="$(command -v mpicc)"
  export MPICXX="${MPICXX:-$(command -v mpicxx || command -v mpic++ || true)}"
  "${pip[@]}" install --no-binary=mpi4py --no-cache-dir "mpi4py>=4.0"
fi
"${pip[@]}" install "jax==$jax_pin" "jaxlib==$jax_pin" "nanobind>=2.0" cython

want_cuda=0
case ",$extras," in *,cuda,*) want_cuda=1 ;; esac
if [ "$want_cuda" = 1 ]; then
  # The CUDA plugin first: pip's CUDA packages bring the headers and libcudart that mpi4jax's
  # CUDA extension (plain C++, no nvcc) builds against where no toolkit is installed.
  "${pip[@]}" install "jax[cuda13]==$jax_pin"
fi

# mpi4jax's CUDA extension: its setup.py derives the toolkit from `nvcc` on PATH
# (dirname(nvcc)/..), which is wrong when nvcc is a wrapper (e.g. /usr/local/bin/nvcc) and
# then fails with "cuda_runtime.h: No such file". Point CUDA_ROOT at the folder whose
# include/ really holds cuda_runtime.h; with no such folder, point it at an empty one so
# that only the CPU extension is built.
find_cuda_root() {
  local cand nvcc real
  for cand in "${CUDA_ROOT:-}" "${CUDA_PATH:-}" "${CUDA_HOME:-}"; do
    [ -n "$cand" ] && [ -f "$cand/include/cuda_runtime.h" ] && { echo "$cand"; return; }
  done
  nvcc="$(command -v nvcc || true)"
  if [ -n "$nvcc" ]; then
    real="$(readlink -f "$nvcc")"
    cand="$(dirname "$(dirname "$real")")"
    [ -f "$cand/include/cuda_runtime.h" ] && { echo "$cand"; return; }
    # a shell wrapper that execs the real nvcc
    real="$(grep -o '/[^ "]*/bin/nvcc' "$nvcc" 2>/dev/null | head -n 1 || true)"
    if [ -n "$real" ]; then
      cand="$(dirname "$(dirname "$(readlink -f "$real")")")"
      [ -f "$cand/include/cuda_runtime.h" ] && { echo "$cand"; return; }
    fi
  fi
  for cand in /usr/local/cuda /opt/cuda; do
    [ -f "$cand/include/cuda_runtime.h" ] && { echo "$cand"; return; }
  done
  [ "$want_cuda" = 1 ] && pip_cuda_root
}
# With the cuda extra and no toolkit: pip's CUDA runtime (site-packages/nvidia/cu13), seen
# through a folder of links, because it ships libcudart.so.13 without the libcudart.so that
# `-lcudart` needs; the extension finds the library again through an rpath (LDFLAGS).
pip_cuda_root() {
  local site cu link
  site="$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  cu="$site/nvidia/cu13"
  [ -f "$cu/include/cuda_runtime.h" ] && [ -f "$cu/lib/libcudart.so.13" ] || return 0
  link="$venv/.pip-cuda"
  mkdir -p "$link/lib"
  ln -sfn "$cu/include" "$link/include"
  ln -sfn "$cu/lib/libcudart.so.13" "$link/lib/libcudart.so"
  echo "$link"
}
cuda_rpath=""
cuda_root="$(find_cuda_root || true)"
[ "$cuda_root" = "$venv/.pip-cuda" ] && cuda_rpath="$(readlink -f "$cuda_root/lib/libcudart.so" | xargs dirname)"
cpu_only_root() {  # exists, has no include/: mpi4jax builds its CPU extension only
  mkdir -p "$venv/.no-cuda"
  echo "$venv/.no-cuda"
}
if [ -z "$cuda_root" ]; then
  cuda_root="$(cpu_only_root)"
  if [ "$want_cuda" = 1 ]; then
    echo "setup.sh: MNJAX_EXTRAS=cuda, but no CUDA headers (include/cuda_runtime.h) were" \
         "found, neither a toolkit nor pip's CUDA runtime: building mpi4jax for CPU only. The" \
         "xla kind and deviceless GPU compiles work; for the MPI kinds on GPUs load the" \
         "toolkit (module load cuda) or set CUDA_ROOT and rerun." >&2
  else
    echo "setup.sh: no CUDA toolkit headers found; building mpi4jax for CPU only" >&2
  fi
else
  echo "setup.sh: building mpi4jax with CUDA from $cuda_root" >&2
fi
mpi4jax_build() {  # pip install arguments...; with CUDA, falls back to a CPU-only build
  local ldflags="${LDFLAGS:-}"
  [ -n "$cuda_rpath" ] && ldflags="$ldflags -Wl,-rpath,$cuda_rpath"
  if CUDA_ROOT="$cuda_root" CUDA_PATH="" LDFLAGS="$ldflags" "${pip[@]}" "$@"; then
    return 0
  fi
  [ "$cuda_root" = "$venv/.no-cuda" ] && return 1
  echo "setup.sh: mpi4jax did not build with CUDA from $cuda_root (see above); building it" \
       "for CPU only: the MPI kinds cannot run on GPUs, the xla kind and deviceless GPU" \
       "compiles can" >&2
  CUDA_ROOT="$(cpu_only_root)" CUDA_PATH="" "${pip[@]}" "$@" --no-cache-dir --force-reinstall
}
mpi4jax_cuda() {  # 0 when mpi4jax's CUDA extension loads
  "$venv/bin/python" -c "import sys; from mpi4jax._src import xla_bridge as b; sys.exit(0 if b.HAS_CUDA_EXT else 1)" 2>/dev/null
}
if ! "$venv/bin/python" -c "import mpi4jax" 2>/dev/null; then
  # --no-cache-dir with CUDA: pip's cache may hold a wheel built without it.
  mpi4jax_build install --no-build-isolation --no-deps \
    $({ [ "$want_cuda" = 1 ] || [ "$mpi_kind" = system ]; } && echo --no-cache-dir) "mpi4jax==$mpi4jax_pin"
elif [ "$want_cuda" = 1 ] && ! mpi4jax_cuda && [ "$cuda_root" != "$venv/.no-cuda" ]; then
  # A venv first built for CPU: rebuild from source (not from pip's cache of the CPU wheel).
  echo "setup.sh: the installed mpi4jax has no CUDA extension; rebuilding it with CUDA" >&2
  mpi4jax_build install --no-build-isolation --no-deps --no-cache-dir --force-reinstall \
    "mpi4jax==$mpi4jax_pin"
fi

spec="$repo[test"
[ "$mpi_kind" = mpich ] && spec="$spec,mpich"
[ -n "$extras" ] && spec="$spec,$extras"
spec="$spec]"
"${pip[@]}" install -e "$spec"

# mnjax's MPI handlers for XLA:CPU (mnjax/comm/_instep/_native): compiled with the same MPI compiler
# wrapper; rebuilt automatically on first use whenever the source is newer.
PATH="$venv/bin:$PATH" "$venv/bin/python" -m mnjax.comm._instep._native >/dev/null
"$venv/bin/python" -c "import mnjax, mpi4jax" >/dev/null
if [ "$mpi_kind" = system ]; then  # say which MPI the venv runs on (mpi4jax checked its ABI)
  echo "setup.sh: MPI: $("$venv/bin/python" -c "from mpi4py import MPI; print(MPI.Get_library_version().strip(chr(0)).splitlines()[0])")" >&2
fi
if [ "$want_cuda" = 1 ]; then
  gpus="$("$venv/bin/python" -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0)"
  if ! mpi4jax_cuda; then
    echo "setup.sh: mpi4jax's CUDA extension does not load (built from $cuda_root; import" \
         "mpi4jax._src.xla_bridge.mpi_xla_bridge_cuda to see why; a toolkit newer than the" \
         "driver?). The MPI kinds cannot run on GPUs; kind 'xla' and deviceless GPU compiles can." >&2
    [ "$gpus" = 0 ] || exit 2  # on a GPU machine that is a broken install
  fi
  if [ "$gpus" = 0 ]; then
    echo "setup.sh: note: JAX's CUDA plugin is installed but sees no GPU here (a login node," \
         "or no driver: nvidia-smi). Runs on GPU nodes will use it; runs here fail with how to" \
         "fix it unless JAX_PLATFORMS=cpu." >&2
  else
    echo "setup.sh: JAX sees $gpus GPU(s); mpi4jax's CUDA extension loads" >&2
  fi
fi
# How mpi4jax hands GPU buffers to MPI (scripts/activate.sh exports it): the mpich wheel
# is not CUDA-aware, so buffers go through host memory; a cluster MPI is the user's call.
echo "$mpi_kind" > "$venv/.mnjax-mpi"
echo "$stamp" > "$venv/.mnjax-stamp"
echo "setup.sh: ready ($venv)" >&2
