"""experiments/train.py with every step slowed down: ``slow_train.py SECONDS [train.py flags]``.

tests/jobs/test_workdir_jobs.py starts a second run in the same work directory while this one
still trains (the digits train in about a second otherwise)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import train

import mnjax


def main(seconds: float, argv: list[str]) -> None:
  config = train.parse_args(argv)
  comm = mnjax.create_communicator(config.comm)
  make_train_step = train.make_train_step

  def make_slow_step(comm):
    step_fn = make_train_step(comm)

    def step(*args):
      time.sleep(seconds)
      return step_fn(*args)
    return step

  train.make_train_step = make_slow_step
  train.train_and_evaluate(config, comm)


if __name__ == "__main__":
  main(float(sys.argv[1]), sys.argv[2:])
