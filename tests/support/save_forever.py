"""Saves checkpoints 1, 2, 3, ... of a 192 MB state until killed: ``save_forever.py DIR [POINT]``.

Prints ``saving N`` before each save and ``saved N`` once it is on disk, for
tests/jobs/test_checkpoint_kill.py. With POINT, the process SIGKILLs itself at that point of
saving step 3 (printing ``killed at POINT`` first):

- ``host_copy``: after the state was copied to host memory and hashed, before orbax runs;
- ``commit``: after orbax wrote every file into its temporary directory, before the
  commit marker and the rename;
- ``before_rename`` / ``after_rename``: around the rename that publishes the checkpoint.

The hooks patch orbax internals (orbax.checkpoint._src.path.async_path); the test checks
that each one fired, so an orbax change that moves them fails loudly.
"""

import os
import signal
import sys

import jax.numpy as jnp
from mpi4py import MPI
from orbax.checkpoint._src.path import async_path

import mnjax
from mnjax.checkpoint import _verify as verify

SHAPE = (3, 1 << 24)  # 3 x 64 MiB of float32: a save takes a good fraction of a second
_current = {"step": 0}


def state(step: int) -> dict:
  return {"a": jnp.full(SHAPE, float(step)), "step": step}


def die(point: str) -> None:
  print(f"killed at {point}", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
  def armed(name):
    return point == name and _current["step"] == 3

  digests, write_text, rename = verify.record_digests, async_path.write_text, async_path.rename

  def patched_digests(tree):
    out = digests(tree)
    if armed("host_copy"):
      die(point)
    return out

  async def patched_write_text(path, text, *args, **kwargs):
    # The step's own marker (items inside it have their own markers and renames, earlier).
    if armed("commit") and path.parent.name.startswith("3.orbax-checkpoint-tmp"):
      die(point)
    return await write_text(path, text, *args, **kwargs)

  async def patched_rename(src, dst):
    final = dst.name == "3"
    if armed("before_rename") and final:
      die(point)
    result = await rename(src, dst)
    if armed("after_rename") and final:
      die(point)
    return result

  verify.record_digests = patched_digests
  async_path.write_text = patched_write_text
  async_path.rename = patched_rename


def main(directory: str, point: str | None) -> None:
  if point:
    install(point)
  comm = mnjax.create_communicator("flat", MPI.COMM_SELF)
  with mnjax.Checkpointer(directory, comm, keep=3) as ckpt:
    step = 0
    while True:
      step += 1
      _current["step"] = step
      print(f"saving {step}", flush=True)
      ckpt.save(step, state(step))
      ckpt.wait()
      print(f"saved {step}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
