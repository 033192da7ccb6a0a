"""Command-line flags from a frozen config dataclass and config files with ``get_config()``.

An experiment declares what defines a run once, as a frozen dataclass; its configs are
files (``experiments/configs/NAME.py``) whose ``get_config()`` returns a dict of field
values, each file's docstring giving the command that runs it and how long it takes (as
flax's examples and big_vision do). `parse_flags` builds the parser from the dataclass:
``--config NAME`` (or a path to such a file) picks the values, and every field can then be
overridden by ``--field value`` (booleans as ``--x`` / ``--no-x``)::

    python experiments/imagenet.py --config resnet18_cifar10 --epochs 3 --no-sync_bn

Values are checked in one place, when the dataclass is built (`check_fields`: a field's
``choices`` and ``minimum``, declared with `flag`): from a config file, a flag or code alike,
a bad value fails with the field, what came and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_fields", "flag", "load_config", "parse_flags"]

_TYPES = {bool: bool, int: int, float: float, str: str}


def flag(default: Any = dataclasses.MISSING, *, choices: Sequence[Any] | None = None,
         minimum: float | None = None, help: str = "") -> Any:
  """A config dataclass field with a check and a ``--help`` line (`check_fields` applies it).

  Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Config:
    ...   optimizer: str = flag("sgd", choices=("sgd", "adam"), help="the update rule")
    ...   epochs: int = flag(10, minimum=1)
    ...   def __post_init__(self):
    ...     check_fields(self)
    >>> Config(epochs=0)
    Traceback (most recent call last):
    ValueError: Config: epochs (--epochs) must be >= 1, got 0.
  """
  metadata = {"help": help}
  if choices is not None:
    metadata["choices"] = tuple(choices)
  if minimum is not None:
    metadata["minimum"] = minimum
  return dataclasses.field(default=default, metadata=metadata)


def _types(config_type: type) -> dict[str, type]:
  hints = typing.get_type_hints(config_type)
  out = {}
  for field in dataclasses.fields(config_type):
    kind = hints[field.name]
    if kind not in _TYPES:
      raise TypeError(f"{config_type.__name__}.{field.name}: flags support bool, int, float and"
                      f" str fields, got {kind}.")
    out[field.name] = kind
  return out


def check_fields(config: Any) -> None:
  """Raises `ValueError` for a field of the dataclass `config` outside its declared
  ``choices`` or below its ``minimum`` (see `flag`), or of the wrong type; call it from
  ``__post_init__``.

  Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Config:
    ...   kind: str = flag("flat", choices=("flat", "xla"))
    ...   def __post_init__(self):
    ...     check_fields(self)
    >>> Config(kind="ring")
    Traceback (most recent call last):
    ValueError: Config: kind (--kind) must be one of ['flat', 'xla'], got 'ring'.
  """
  name = type(config).__name__
  for field, kind in zip(dataclasses.fields(config), _types(type(config)).values()):
    value = getattr(config, field.name)
    where = f"{name}: {field.name} (--{field.name})"
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      ok = True
    if not ok:
      raise ValueError(f"{where} must be of type {kind.__name__}, got {value!r}.")
    choices = field.metadata.get("choices")
    if choices is not None and value not in choices:
      raise ValueError(f"{where} must be one of {list(choices)}, got {value!r}.")
    minimum = field.metadata.get("minimum")
    if minimum is not None and value < minimum:
      raise ValueError(f"{where} must be >= {minimum}, got {value!r}.")


def _config_path(name: str, configs_dir: str | os.PathLike, aliases: Mapping[str, str]) -> Path:
  if name.endswith(".py") or os.sep in name:
    return Path(name).expanduser()
  return Path(configs_dir) / f"{aliases.get(name, name)}.py"


def _available(configs_dir: str | os.PathLike, aliases: Mapping[str, str]) -> list[str]:
  names = [p.stem for p in Path(configs_dir).glob("*.py") if not p.name.startswith("_")]
  return sorted({*names, *aliases})


def load_config(config_type: type, name: str, *, configs_dir: str | os.PathLike,
                aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
  """The field values config `name` gives: ``get_config()`` of ``configs_dir/NAME.py`` (after
  `aliases`), or of the file `name` when it is a path. Raises `ValueError` for a missing
  file, a ``get_config()`` that does not return a dict, or a key that is not a field.

  Example:
    >>> load_config(Config, "digits", configs_dir="experiments/configs")  # doctest: +SKIP
    {'dataset': 'digits', 'epochs': 20, 'global_batch_size': 64, ...}
  """
  aliases = dict(aliases or {})
  path = _config_path(name, configs_dir, aliases)
  if not path.is_file():
    raise ValueError(
        f"--config {name!r}: no config file {path}. Choose one of"
        f" {_available(configs_dir, aliases)} or pass the path of a .py file that defines"
        " get_config().")
  spec = importlib.util.spec_from_file_location(f"_mnjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise ValueError(f"--config {name!r}: {path} defines no get_config().")
  values = get_config()
  if not isinstance(values, Mapping):
    raise ValueError(f"--config {name!r}: {path}'s get_config() must return a dict of"
                     f" {config_type.__name__} fields, got {type(values).__name__}.")
  fields = {f.name for f in dataclasses.fields(config_type)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ValueError(f"--config {name!r}: {path} sets {unknown}, which are not fields of"
                     f" {config_type.__name__}; the fields are {sorted(fields)}.")
  return dict(values)


def parse_flags(config_type: type, argv: Sequence[str] | None = None, *, default: str,
                configs_dir: str | os.PathLike, aliases: Mapping[str, str] | None = None,
                description: str | None = None) -> Any:
  """A `config_type` instance from ``--config`` and the flags in `argv` (``sys.argv`` if
  None); errors (an unknown config, a bad value) exit with argparse's usage message.

  Args:
    config_type: a frozen dataclass of bool, int, float and str fields; fields without a
      default must come from the config file or a flag.
    argv: the command-line arguments, without the program name.
    default: the config used without ``--config``.
    configs_dir: where ``--config NAME`` finds ``NAME.py``.
    aliases: other names of configs (``{"cifar10": "resnet18_cifar10"}``).
    description: ``--help``'s first line.

  Example:
    >>> config = parse_flags(Config, ["--config", "resnet18_cifar10", "--epochs", "3"],
    ...                      default="digits", configs_dir="experiments/configs")  # doctest: +SKIP
  """
  aliases = dict(aliases or {})
  types = _types(config_type)
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--config", default=default,
                   help=f"a config of {configs_dir} ({', '.join(_available(configs_dir, aliases))})"
                   " or the path of a .py file with get_config(); flags override its values"
                   f" (default: {default})")
  known, _ = pre.parse_known_args(argv)
  parser = argparse.ArgumentParser(description=description, parents=[pre],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  try:
    values = load_config(config_type, known.config, configs_dir=configs_dir, aliases=aliases)
  except ValueError as e:
    parser.error(str(e))
  for field in dataclasses.fields(config_type):
    kind = types[field.name]
    if field.name in values:
      default_value = values[field.name]
    elif field.default is not dataclasses.MISSING:
      default_value = field.default
    else:
      default_value = None
    options: dict[str, Any] = {"default": default_value, "help": field.metadata.get("help", "")}
    if default_value is None:
      options["required"] = True
    if kind is bool:
      options["action"] = argparse.BooleanOptionalAction
    else:
      options["type"] = kind
    if "choices" in field.metadata:
      listed = ", ".join(map(str, field.metadata["choices"]))
      options["help"] = f"{options['help']} (one of {listed})"
    parser.add_argument(f"--{field.name}", **options)
  args = vars(parser.parse_args(argv))
  args.pop("config")
  try:
    return config_type(**args)
  except ValueError as e:
    parser.error(str(e))
