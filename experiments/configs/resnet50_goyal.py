"""ResNet-50 on ImageNet-1k at 224 px, Goyal et al.'s recipe (lr 0.1 x global/256, 5 warmup
epochs, /10 at epochs 30, 60 and 80), label smoothing 0.1, synchronized BN, 90 epochs: the
ChainerMN experiment (also ``--config imagenet``). With the data prepared once
(``tfds build imagenet2012 --data_dir /shared/tfds --file_format array_record``), 32 images
per replica on 128 GPUs:

    srun -N 32 --ntasks-per-node 4 python experiments/imagenet.py --config resnet50_goyal \\
        --data_dir /shared/tfds --global_batch_size 4096 --workdir runs/r50

Time: not run here (no GPU cluster); ChainerMN reports 4.4 hours for 90 epochs on 128
P100s.
"""


def get_config() -> dict:
  return {
      "dataset": "imagenet2012",
      "model": "resnet50",
      "stem": "imagenet",
      "epochs": 90,
      "global_batch_size": 256,
      "label_smoothing": 0.1,
      "workdir": "runs/resnet50-imagenet",
  }
