"""ResNet-18 (CIFAR stem, synchronized BN) on CIFAR-10, Goyal et al.'s recipe, 128 images per
step, 30 epochs (also ``--config cifar10``). The data is prepared once with
``tfds build cifar10 --data_dir ~/tensorflow_datasets --file_format array_record``:

    mpirun -n 2 python experiments/imagenet.py --config resnet18_cifar10 \\
        --data_dir ~/tensorflow_datasets

Time: a GPU run; not run here in full. On this project's 2-core CPU machine ResNet-18 at
32 px trains at 8.6 img/s on 2 ranks (measured on mocked CIFAR-10), about 1.6 hours per
epoch. tests/jobs/test_imagenet_job.py runs it on 32 mocked examples with 8 per step.
"""


def get_config() -> dict:
  return {
      "dataset": "cifar10",
      "model": "resnet18",
      "stem": "cifar",
      "epochs": 30,
      "global_batch_size": 128,
      "workdir": "runs/resnet18-cifar10",
  }
