"""`lab.aot` without the CUDA plugin (the default, CPU-only install): targets parse or fail
naming the known ones, and ``python -m lab.bench aot`` says in one line how to install
what it needs. The compiles themselves are tests/aot (the plugin's venv)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab import aot

REPO = Path(__file__).resolve().parents[2]


def test_targets_are_nodes_by_gpus_of_a_known_gpu():
  assert aot.parse_target("8xH200") == aot.Target(1, 8, "H200")
  assert aot.parse_target("4x8xh200").gpus == 32
  assert set(aot.gpu_names()) == {"H100", "H200"}
  for gpu in aot.gpu_names():  # every number has its source in a comment
    text = aot.target_config(gpu)
    assert 'platform_name: "CUDA"' in text and "device_memory_size" in text
    sourced, unsourced = [False], []  # a block's opening line may cite for its fields
    for line in text.splitlines():
      if line.rstrip().endswith("{") or "{" in line.split("#")[0]:
        sourced.append(sourced[-1] or "#" in line)
      elif line.strip().startswith("}"):
        sourced.pop()
      elif re.match(r"^\s*\w+: [\d.]+", line) and "#" not in line and not sourced[-1]:
        unsourced.append(line)
    assert not unsourced, f"{gpu}: numbers without a source comment: {unsourced}"


@pytest.mark.parametrize(("spec", "message"), [
    ("8xA100", "unknown GPU 'A100' in '8xA100'; known: H100, H200"),
    ("H200", "is not a target; write GPUSxNAME"),
    ("0x8xH200", "needs at least one node"),
])
def test_unknown_gpu_or_topology_is_a_clear_error(spec, message):
  with pytest.raises(ValueError, match=message):
    aot.parse_target(spec)


@pytest.mark.skipif(aot.plugin_installed(), reason="this venv has the CUDA plugin")
@pytest.mark.slow  # over 1.5 s alone: the full suite runs it, the fast subset does not
def test_bench_without_the_plugin_says_how_to_install_it_in_one_line():
  out = subprocess.run([sys.executable, "-m", "lab.bench", "aot", "--quick"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
  assert "MNJAX_EXTRAS=cuda MNJAX_VENV=.venv-cuda scripts/setup.sh" in lines[0]
