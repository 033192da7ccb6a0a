"""The docs keep up with the code: the API table, the file map, the test files, links.

Rules (fast, no MPI launch; the library is imported, nothing runs):

* API table (docs/api.md): every public name has a row. Public: every name in
  ``mnjax.__all__``, in the ``__all__`` of every subpackage listed there (``mnjax.comm``,
  ...) and, recursively, of every public module listed in one (``mnjax.optim.recipes``).
  A name ``X`` of module ``M`` counts as documented when a code span
  in docs/api.md *starts with* the qualified name ``M.X`` followed by nothing, ``(`` or any
  character that cannot continue a dotted name: ```mnjax.comm.abort(message)``` documents
  ``mnjax.comm.abort``; ```mnjax.broadcast``` documents the top-level ``broadcast``; an
  unqualified ```abort``` documents nothing (``allgather`` is in two subpackages).
* File map (docs/design/overview.md): every ``.py`` file under mnjax/ and lab/ appears as its
  path from the checkout root in a code span (```mnjax/comm/_instep/_buckets.py```); a package's
  ``__init__.py`` and ``__main__.py`` are covered by the package folder with a trailing
  slash (```mnjax/comm/```), which must appear too.
* No private module of mnjax (``mnjax.comm._instep._recorder``: a dotted name with a component that
  starts with ``_``) is named in docs/api.md or README.md.
* docs/testing.md has one row per file under tests/, holding the first paragraph of that
  file's docstring on one line.
* Every relative link ``[text](target)`` in README.md, docs/*.md and docs/design/overview.md
  points to an existing file or folder (fragments ignored; http(s), mailto and ``#anchor``
  links skipped; fenced code blocks ignored).
"""

import importlib
import pathlib
import re
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
OVERVIEW = ROOT / "docs" / "design" / "overview.md"
README = ROOT / "README.md"
MAPPED_PACKAGES = ("mnjax", "lab")
PRIVATE = re.compile(r"\bmnjax(?:\.\w+)*\._(?!_)\w*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def _without_fences(text: str) -> str:
  """`text` with fenced code blocks blanked out, line numbers kept."""
  return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _code_spans(text: str) -> list[str]:
  return re.findall(r"`([^`\n]+)`", _without_fences(text))


def _public_names() -> list[str]:
  """Every public qualified name: ``module.name`` for each name in each public `__all__`."""
  names, todo, seen = [], ["mnjax"], set()
  while todo:
    module_name = todo.pop(0)
    if module_name in seen:
      continue
    seen.add(module_name)
    module = importlib.import_module(module_name)
    for name in getattr(module, "__all__", ()):
      names.append(f"{module_name}.{name}")
      value = getattr(module, name)
      if isinstance(value, types.ModuleType) and value.__name__.startswith("mnjax."):
        todo.append(value.__name__)
  return names


def _documents(span: str, qualified: str) -> bool:
  return re.match(re.escape(qualified) + r"(?![\w.])", span) is not None


def test_every_public_name_is_in_the_api_table():
  spans = _code_spans(API.read_text())
  missing = [q for q in _public_names() if not any(_documents(s, q) for s in spans)]
  assert not missing, (
      f"{_rel(API)} has no row for these public names: {', '.join(missing)}. Add one row per"
      " name to the table of its subpackage, its first cell the qualified name in backticks"
      " with its signature (e.g. `mnjax.comm.abort(message, *, errorcode=1, grace=1.0)`; a"
      " top-level re-export also as `mnjax.NAME`), then one or two short sentences. If a name"
      " is not meant to be public, remove it from its module's __all__ instead.")


def _mapped_files() -> tuple[list[str], list[str]]:
  """(module paths, package folders with a trailing slash) under mnjax/ and lab/."""
  modules, packages = [], []
  for top in MAPPED_PACKAGES:
    for path in sorted((ROOT / top).rglob("*.py")):
      if "__pycache__" in path.parts:
        continue
      if path.name in ("__init__.py", "__main__.py"):
        if path.name == "__init__.py":
          packages.append(_rel(path.parent) + "/")
      else:
        modules.append(_rel(path))
  return modules, packages


def test_every_module_is_in_the_file_map():
  spans = set(_code_spans(OVERVIEW.read_text()))
  modules, packages = _mapped_files()
  missing_modules = [m for m in modules if m not in spans]
  missing_packages = [p for p in packages if p not in spans]
  messages = []
  if missing_modules:
    messages.append(
        f"these modules are not in the file map of {_rel(OVERVIEW)}: "
        f"{', '.join(missing_modules)}. Add a row to the table of its package (section 'Where"
        " each piece lives'): the path in backticks, then a few words on what it holds")
  if missing_packages:
    messages.append(
        f"these packages are not in the file map of {_rel(OVERVIEW)}: "
        f"{', '.join(missing_packages)}. Name each as its folder with a trailing slash in"
        " backticks (e.g. `mnjax/comm/`) in the heading or a row of its section, with one"
        " sentence on what it is for")
  assert not messages, "; ".join(messages) + "."


@pytest.mark.parametrize("doc", [API, README], ids=lambda p: _rel(p))
def test_no_private_module_is_named(doc):
  hits = []
  for number, line in enumerate(doc.read_text().splitlines(), 1):
    hits += [f"line {number}: {m.group(0)}" for m in PRIVATE.finditer(line)]
  assert not hits, (
      f"{_rel(doc)} names private modules of mnjax ({'; '.join(hits)}). Name the public way"
      " instead (a name in a subpackage's __all__, see docs/api.md), or drop the sentence;"
      " for the files behind a package, docs/design/overview.md's file map is the place.")


def _docs_with_links() -> list[pathlib.Path]:
  return [README, *sorted((ROOT / "docs").glob("*.md")), OVERVIEW]


@pytest.mark.parametrize("doc", _docs_with_links(), ids=lambda p: _rel(p))
def test_relative_links_point_to_existing_files(doc):
  broken = []
  text = _without_fences(doc.read_text())
  for number, line in enumerate(text.splitlines(), 1):
    for target in LINK.findall(line):
      if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        continue  # a URL, mailto: or an anchor in the same file
      path = target.split("#", 1)[0]
      if path and not (doc.parent / path).exists():
        broken.append(f"line {number}: ({target})")
  assert not broken, (
      f"{_rel(doc)} links to files that do not exist: {'; '.join(broken)} (paths are"
      f" relative to {_rel(doc.parent) or '.'}/). Fix the path or remove the link.")


TESTING = ROOT / "docs" / "testing.md"


def _first_paragraph(path: pathlib.Path) -> str:
  import ast

  doc = ast.get_docstring(ast.parse(path.read_text())) or ""
  return " ".join(doc.split("\n\n")[0].split()).replace("|", "/")


def test_the_testing_page_lists_every_test_file_by_its_docstring():
  """docs/testing.md's table row of each file under tests/ is its docstring's first paragraph."""
  rows = dict(re.findall(r"^\| `(tests/[^`]+\.py)` \| (.*) \|$", TESTING.read_text(), re.M))
  files = {_rel(p): _first_paragraph(p) for p in sorted((ROOT / "tests").rglob("*.py"))}
  missing = sorted(set(files) - set(rows))
  gone = sorted(set(rows) - set(files))
  stale = sorted(f for f in set(files) & set(rows) if files[f] != rows[f])
  problems = []
  if missing:
    problems.append(f"not in docs/testing.md's table of test files: {missing}")
  if gone:
    problems.append(f"rows of docs/testing.md for files that no longer exist: {gone}")
  if stale:
    problems.append(f"rows of docs/testing.md that differ from their file's docstring (first"
                    f" paragraph): {stale}")
  assert not problems, ("; ".join(problems) + ". Each row is `| `path` | first paragraph of the"
                        " file's docstring, on one line |`: update the row from the docstring.")
