"""ResNet-50 on random ImageNet-shaped images, 10 steps per epoch, 2 epochs, no evaluation:
throughput without a dataset (also ``--config synthetic``).

    python experiments/imagenet.py --config resnet50_synthetic --image_size 64 \\
        --steps_per_epoch 5 --workdir runs/synthetic-1rank             # the 1-rank baseline
    mpirun -n 2 python experiments/imagenet.py --config resnet50_synthetic --image_size 64 \\
        --steps_per_epoch 5 --baseline_workdir runs/synthetic-1rank    # + parallel efficiency

Measured on this project's 2-core CPU machine (shared, load 4-5), 2 ranks, the command
above without ``--baseline_workdir``: 93 s wall clock (mostly compilation), 16.5 img/s (8.3
per rank) in the second epoch.
"""


def get_config() -> dict:
  return {
      "dataset": "synthetic",
      "model": "resnet50",
      "stem": "imagenet",
      "epochs": 2,
      "steps_per_epoch": 10,
      "global_batch_size": 32,
      "eval": False,
      "workdir": "runs/resnet50-synthetic",
  }
