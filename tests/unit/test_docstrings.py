"""Every docstring example in mnjax runs (size-1 communicator), unless marked to skip.

An example that needs what a test cannot have here (a GPU, a dataset on disk, several ranks,
a variable the prose defines) carries ``# doctest: +SKIP``; everything else runs, with the
usual names in scope: ``mnjax, jax, jnp, np, optax, nn`` and a size-1 ``comm``.
"""

import doctest
import importlib
import pkgutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mnjax

# Entry points that start processes or re-launch themselves; their examples are commands.
EXCLUDED = ("mnjax.bench.__main__", "mnjax.comm._native.__main__",
            "mnjax.comm._native._mpi_collectives")  # the last: the compiled handler


def _modules() -> list[str]:
  names = ["mnjax"]
  for info in pkgutil.walk_packages(mnjax.__path__, "mnjax."):
    if info.name not in EXCLUDED:
      names.append(info.name)
  return names


def _examples(name: str) -> list[doctest.DocTest]:
  module = importlib.import_module(name)
  tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
  return [t for t in tests if t.examples and all(
      t.filename == getattr(module, "__file__", t.filename) for _ in [0])]


CASES = [t for name in _modules() for t in _examples(name)]


@pytest.mark.parametrize("test", CASES, ids=[t.name for t in CASES])
def test_docstring_example(test, comm):
  globs = dict(test.globs)
  globs.update(mnjax=mnjax, jax=jax, jnp=jnp, np=np, optax=optax, nn=nn, comm=comm)
  test = doctest.DocTest(test.examples, globs, test.name, test.filename, test.lineno,
                         test.docstring)
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  runner = doctest.DocTestRunner(optionflags=flags)
  failures = []
  runner.run(test, out=failures.append)
  assert runner.failures == 0, "".join(failures)
