"""The flag parser and the config files: ``--config`` picks a file's ``get_config()``, every
field is a flag, bad values fail with what came and what is allowed, and each config file
of experiments/configs/ loads into its experiment and says how to run it and how long."""

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
from support.launch import REPO

from lab.runner import RunConfig, check_fields, flag, load_config, parse_flags

sys.path.insert(0, str(REPO / "experiments"))
import imagenet  # the ResNet experiment
import train  # the main job

CONFIGS = REPO / "experiments" / "configs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toy(RunConfig):
  model: str = flag("small", choices=("small", "big"))
  rate: float = flag(0.1, minimum=0.0)


def write(tmp_path, name, body):
  (tmp_path / f"{name}.py").write_text(f"def get_config():\n  return {body}\n")
  return tmp_path


def test_a_config_file_gives_the_values_and_flags_override_them(tmp_path):
  configs = write(tmp_path, "toy", {"epochs": 3, "global_batch_size": 8, "workdir": "w",
                                    "model": "big"})
  config = parse_flags(Toy, ["--rate", "0.5", "--no-progress", "--resume"], default="toy",
                       configs_dir=configs)
  assert (config.epochs, config.model, config.rate) == (3, "big", 0.5)
  assert config.progress is False and config.resume is True
  assert parse_flags(Toy, ["--model", "small"], default="toy", configs_dir=configs).model == "small"
  # A path instead of a name, and an alias.
  by_path = parse_flags(Toy, ["--config", str(configs / "toy.py")], default="x", configs_dir="/")
  assert by_path.model == "big"
  aliased = parse_flags(Toy, ["--config", "t"], default="x", configs_dir=configs,
                        aliases={"t": "toy"})
  assert aliased == parse_flags(Toy, [], default="toy", configs_dir=configs)


@pytest.mark.parametrize("argv, message", [
    (["--model", "huge"], "Toy: model (--model) must be one of ['small', 'big'], got 'huge'"),
    (["--rate", "-1"], "Toy: rate (--rate) must be >= 0.0, got -1.0"),
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
    (["--epochs", "0"], "Toy: epochs (--epochs) must be >= 1, got 0"),  # no untrained result
    (["--checkpoint_steps", "-1"], "checkpoint_steps (--checkpoint_steps) must be >= 0, got -1"),
    (["--comm", "ring"], "comm (--comm) must be one of ['auto', 'flat'"),
    (["--bucket_mb", "-1"], "--bucket_mb must be 'auto', 0 (one buffer per dtype) or a positive"),
    (["--wire_dtype", "int8"], "wire_dtype must be None"),
    (["--profile_steps", "10:5"], "--profile_steps must be N (trace N steps from the run's"),
    (["--config", "nope"], "--config 'nope': no config file"),
    (["--config", "extra"], "sets ['colour'], which are not fields of Toy"),
    (["--config", "partial"], "the following arguments are required: --workdir"),
])
def test_bad_values_exit_with_a_clear_message(tmp_path, capsys, argv, message):
  write(tmp_path, "toy", {"epochs": 3, "global_batch_size": 8, "workdir": "w"})
  write(tmp_path, "extra", {"epochs": 3, "global_batch_size": 8, "workdir": "w", "colour": 1})
  write(tmp_path, "partial", {"epochs": 3, "global_batch_size": 8})
  with pytest.raises(SystemExit) as exit_:
    parse_flags(Toy, argv, default="toy", configs_dir=tmp_path)
  assert exit_.value.code == 2
  assert message in capsys.readouterr().err


def test_values_are_checked_when_built_in_code_too():
  with pytest.raises(ValueError, match=r"keep_checkpoints \(--keep_checkpoints\) must be >= 1"):
    Toy(epochs=1, global_batch_size=8, workdir="w", keep_checkpoints=0)
  with pytest.raises(ValueError, match="must be of type int, got '3'"):
    Toy(epochs="3", global_batch_size=8, workdir="w")
  check_fields(Toy(epochs=1, global_batch_size=8, workdir="w"))


def test_the_flags_tests_and_readme_pass_to_the_experiments_still_parse():
  config = train.parse_args(["--epochs", "3", "--checkpoint_steps", "5", "--no-progress",
                             "--workdir", "w", "--resume", "--global_batch_size", "64",
                             "--comm", "hierarchical", "--wire_dtype", "bfloat16",
                             "--bucket_mb", "1", "--tensorboard", "", "--profile_steps",
                             "10:13"])
  assert (config.epochs, config.checkpoint_steps, config.progress, config.resume) == (
      3, 5, False, True)
  assert (config.tensorboard, config.profile_steps) == ("", "10:13")
  assert train.parse_args([]) == train.Config(**load_config(train.Config, "digits",
                                                            configs_dir=CONFIGS))
  config = imagenet.parse_args(["--config", "cifar10", "--global_batch_size", "8", "--base_lr",
                                "0.32", "--warmup_epochs", "0", "--epochs", "4",
                                "--checkpoint_every", "2", "--data_dir", "d"])
  assert (config.dataset, config.model, config.global_batch_size, config.base_lr) == (
      "cifar10", "resnet18", 8, 0.32)
  for old, new in imagenet.ALIASES.items():
    assert imagenet.parse_args(["--config", old]) == imagenet.parse_args(["--config", new])
  assert imagenet.parse_args([]).dataset == "digits"
  assert imagenet.parse_args(["--config", "imagenet"]).label_smoothing == 0.1


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.py")), ids=lambda p: p.stem)
def test_every_config_file_loads_and_says_how_to_run_it_and_how_long(path):
  experiment = train if path.stem == "digits" else imagenet
  config = experiment.parse_args(["--config", path.stem])
  assert config.workdir.startswith("runs/")
  doc = ast.get_docstring(ast.parse(path.read_text()))
  script = f"experiments/{Path(experiment.__file__).name}"
  assert script in doc, doc
  assert "Measured" in doc or "not run here" in doc, doc
