"""The picture in README and docs/design/timeline.md: digits training with one slow rank.

    MNJAX_TIMELINE=runs/timeline/trace.json .venv/bin/mpirun --bind-to core -n 2 \
        .venv/bin/python docs/design/timeline_example.py 0.05 --dataset digits --epochs 2 \
        --workdir runs/timeline/w --no-progress
    .venv/bin/python -m lab.timeline view runs/timeline/trace.json --steps 3 \
        --first 30 --out docs/timeline.png

experiments/train.py, except that the last rank sleeps SECONDS inside every train step (a
host callback before the forward pass, as a slow input pipeline or a slower GPU would make
it late): the timeline shows the other ranks waiting for it at the first gradient bucket,
and the straggler report names it.
"""

import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import train

import mnjax
from lab.runner._classifier import _train_step, step_for_kind


def main(seconds: float, argv: list[str]) -> None:
  config = train.parse_args(argv)
  comm = mnjax.create_communicator(config.comm)

  def nap(x):
    if comm.rank == comm.size - 1:
      time.sleep(seconds)
    return x

  def slow_step(state, images, labels, axis_name=None):
    images = jax.pure_callback(nap, images, images)  # the last rank starts late
    return _train_step(state, images, labels, axis_name=axis_name)

  train.make_train_step = lambda comm: step_for_kind(slow_step, comm)
  train.train_and_evaluate(config, comm)


if __name__ == "__main__":
  main(float(sys.argv[1]), sys.argv[2:])
