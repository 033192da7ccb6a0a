"""experiments/train.py, with the background write of one checkpoint failing as on a full
disk: ``failing_save_train.py STEP [train.py flags]``.

`fail_save` makes orbax's write of checkpoint ``STEP`` raise ``OSError(ENOSPC)`` in its
background thread, where a full disk raises it (orbax logs it and goes on: the step is never
published). tests/jobs/test_save_failure.py checks that the run stops on every rank before
it records the next epoch, and that ``--resume`` then leaves ``metrics.jsonl`` matching the
checkpoint; tests/distributed/test_checkpointer.py uses `fail_save` directly.

The hook patches an orbax internal (orbax.checkpoint._src.path.async_path.write_text, which
writes the step's commit marker); `fired` tells a test it ran, so an orbax change that moves
it fails loudly instead of passing.
"""

import errno
import sys
from pathlib import Path

from orbax.checkpoint._src.path import async_path

fired: list[int] = []


def fail_save(step: int, patch=setattr) -> None:
  """From now on, writing checkpoint `step` fails with ``OSError(ENOSPC)`` (`patch`: e.g.
  pytest's ``monkeypatch.setattr``, to undo it after a test)."""
  write_text = async_path.write_text

  async def full_disk(path, text, *args, **kwargs):
    if path.parent.name.startswith(f"{step}.orbax-checkpoint-tmp"):  # the step's own marker
      fired.append(step)
      print(f"failing the write of checkpoint {step}", flush=True)
      raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return await write_text(path, text, *args, **kwargs)

  patch(async_path, "write_text", full_disk)


def main(step: int, argv: list[str]) -> None:
  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
  import train

  fail_save(step)
  train.main(argv)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2:])
