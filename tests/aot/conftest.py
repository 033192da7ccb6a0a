"""tests/aot run in the CUDA plugin's venv (``MNJAX_EXTRAS=cuda MNJAX_VENV=.venv-cuda
scripts/setup.sh``; ``.ci/run`` runs them there) and are not collected elsewhere. They compile
for GPUs that are not here: JAX itself runs on the CPU only."""

import os

from support.launch import COMPILE_FAST

from lab import aot

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before the plugin starts
# tests/conftest.py lowers the backend's optimisation level for every process of the suite:
# these compiles keep XLA's defaults (read when the first backend starts, after this).
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(COMPILE_FAST, "").strip()
if not aot.plugin_installed():
  collect_ignore_glob = ["test_*.py"]
else:
  import jax

  jax.config.update("jax_platforms", "cpu")  # the CUDA backend cannot start without a GPU
  jax.config.update("jax_disable_most_optimizations", False)  # tests/conftest.py turns it on
  # A deviceless executable cannot be read back from the persistent cache (tests/conftest.py
  # sets one up): JAX would warn on every compile.
  jax.config.update("jax_enable_compilation_cache", False)
