"""ResNet-18 (CIFAR stem, synchronized BN) on the 8x8 UCI digits: the ChainerMN experiment's
offline config, and experiments/imagenet.py's default (also ``--config digits``).

    mpirun -n 2 python experiments/imagenet.py
    python experiments/imagenet.py --epochs 3        # one process

Measured on this project's 2-core CPU machine (shared, load 4-5), 2 ranks, ``--epochs 3``:
84 s wall clock, about 17 s per epoch once compiled (82 img/s), 95.8% test top-1 after 3
epochs; the 10 default epochs take about 3.5 minutes.
"""


def get_config() -> dict:
  return {
      "dataset": "digits",
      "model": "resnet18",
      "stem": "cifar",
      "epochs": 10,
      "global_batch_size": 64,
      "workdir": "runs/resnet-digits",
  }
