"""experiments/train.py, with one rank SIGKILLed at a given step: ``killed_train.py RANK STEP
[train.py flags]``. tests/jobs/test_resume.py resumes the run and compares it with one that was
never interrupted."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import train

import mnjax


def main(rank: int, kill_step: int, argv: list[str]) -> None:
  config = train.parse_args(argv)
  comm = mnjax.create_communicator(config.comm)
  make_train_step = train.make_train_step

  def make_killing_step(comm):
    step_fn, calls = make_train_step(comm), [0]

    def step(*args):
      calls[0] += 1
      if comm.rank == rank and calls[0] == kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
      return step_fn(*args)
    return step

  train.make_train_step = make_killing_step
  train.train_and_evaluate(config, comm)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
