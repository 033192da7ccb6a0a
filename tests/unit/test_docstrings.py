"""Every docstring example in mnjax and the lab runs (size-1 communicator), unless skipped.

An example that needs what a test cannot have here (a GPU, a dataset on disk, several ranks,
a launcher, a long run) carries ``# doctest: +SKIP``; everything else runs, with the usual
names in scope: ``mnjax, lab, jax, jnp, np, optax, nn`` and a size-1 ``comm``.

Each example runs in a fresh temporary working directory, so that relative paths such as
``runs/digits`` land there (or it writes under ``tempfile.mkdtemp()``). It must leave the
test process as it found it: the same environment variables, JAX config, working
directory, exception hook and files in the directory the tests started in (but for the venvs
and logs that ``.ci/run``'s background set-ups write there meanwhile).
"""

import doctest
import importlib
import os
import pkgutil
import sys

# Importing scikit-learn sets its KMP_* defaults in os.environ: import it before any example
# (the digits source imports it lazily), so that an example that loads digits is not blamed.
try:
  import sklearn  # noqa: F401
except ImportError:  # the digits examples then fail with their own message
  pass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lab
import mnjax

# Entry points that start processes or re-launch themselves; their examples are commands.
EXCLUDED = ("lab.bench.__main__", "mnjax.comm._instep._native.__main__")
#: The compiled handlers (one library per MPI vendor: `_mpi_collectives`, `-openmpi`, ...).
COMPILED = "mnjax.comm._instep._native._mpi_collectives"


def _modules() -> list[str]:
  names = ["mnjax", "lab"]
  for package in (mnjax, lab):
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
      if info.name not in EXCLUDED and not info.name.startswith(COMPILED):
        names.append(info.name)
  return names


def _examples(name: str) -> list[doctest.DocTest]:
  """The examples written in module `name` itself (not those of the names it imports)."""
  module = importlib.import_module(name)
  tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
  return [t for t in tests if t.examples and t.filename == getattr(module, "__file__", None)]


#: What `.ci/run`'s background set-ups write beside the suite (the CUDA and Open MPI venvs,
#: their logs and lock): they may appear while an example runs.
BACKGROUND = (".venv-", ".ci-")


def _process_state(home: str) -> dict:
  """What an example must not change in the test process."""
  files = sorted(f for f in os.listdir(home) if not f.startswith(BACKGROUND))
  return {"environment": dict(os.environ), "jax config": dict(jax.config.values),
          "working directory": os.getcwd(), "sys.excepthook": sys.excepthook,
          f"files in {home}": files}


CASES = [t for name in _modules() for t in _examples(name)]


def _runs(test: doctest.DocTest) -> bool:
  return any(not e.options.get(doctest.SKIP, False) for e in test.examples)


def test_examples_found():
  assert len(CASES) > 100, [t.name for t in CASES]
  assert sum(map(_runs, CASES)) > 0.7 * len(CASES), "most examples must run, not be skipped"


@pytest.mark.parametrize("test", CASES, ids=[t.name for t in CASES])
def test_docstring_example(test, comm, tmp_path):
  if not _runs(test):
    pytest.skip("every line is marked # doctest: +SKIP")
  globs = dict(test.globs)
  globs.update(mnjax=mnjax, lab=lab, jax=jax, jnp=jnp, np=np, optax=optax, nn=nn, comm=comm)
  test = doctest.DocTest(test.examples, globs, test.name, test.filename, test.lineno,
                         test.docstring)
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  runner = doctest.DocTestRunner(optionflags=flags)
  failures = []
  home = os.getcwd()
  os.chdir(tmp_path)
  try:
    before = _process_state(home)
    runner.run(test, out=failures.append)
    after = _process_state(home)
  finally:
    os.chdir(home)
  assert runner.failures == 0, "".join(failures)
  changed = {key: _difference(before[key], after[key]) for key in before
             if before[key] != after[key]}
  assert not changed, (f"{test.name}: the example changed the test process: {changed}. Restore"
                       " what it changes, write files under tempfile.mkdtemp(), or mark the"
                       " line # doctest: +SKIP.")


def _difference(before, after):
  if isinstance(before, dict):
    keys = set(before) | set(after)
    return {k: (before.get(k), after.get(k)) for k in sorted(keys) if before.get(k) != after.get(k)}
  if isinstance(before, list):
    return {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after))}
  return (before, after)
