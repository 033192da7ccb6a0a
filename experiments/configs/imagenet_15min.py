"""Akiba, Suzuki and Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on
ImageNet in 15 Minutes": ResNet-50 on ImageNet-1k at 224 px, global batch 32768 (39 steps per
epoch), 90 epochs, with the paper's three pieces (`mnjax.optim.recipes`):

* RMSprop warm-up (``rmsprop_warmup``, eta_rmsprop 3e-4, momentum 0.9, decay 0.99) blending
  into momentum SGD on the ELU-shaped ``akiba_blend`` (centre 10, period 5 epochs);
* the slow-start rate (``slow_start_schedule``): 0.1 x 32768 / 256 = 12.8, times 0.5 until
  epoch 40, then 0.075, 0.01 from 70 and 0.001 from 85;
* batch normalization without moving averages: ``mnjax.SyncBatchNorm`` with momentum 0.0,
  so evaluation uses the last minibatch's statistics allreduced over all workers;

and gradients on the wire in float16 (``--wire_dtype float16``, as ChainerMN's
``allreduce_grad_dtype``). Label smoothing 0.1: the sources reachable here (the abstract, a
paper-reading note, a public Chainer reimplementation of the optimizer) give no value, so this
takes Szegedy et al.'s 0.1, the one label-smoothed ImageNet ResNet-50 recipes use and the one
``resnet50_goyal`` uses, so the two configs differ only in the Akiba pieces. Weight decay 1e-4
on kernels, as for every recipe of experiments/imagenet.py.

With the data prepared once (``tfds build imagenet2012 --data_dir /shared/tfds --file_format
array_record``), 32 images per GPU on 1024 GPUs (e.g. 128 nodes of 8):

    srun -N 128 --ntasks-per-node 8 --gpus-per-task 1 python experiments/imagenet.py \\
        --config imagenet_15min --data_dir /shared/tfds --workdir runs/imagenet-15min

Time: not run here (no GPU cluster). The paper: 90 epochs in 15 minutes on 1024 Tesla P100s
(ChainerMN), 74.9% top-1 validation accuracy. The scale-down that runs here is
``akiba_digits``.
"""


def get_config() -> dict:
  return {
      "dataset": "imagenet2012",
      "model": "resnet50",
      "stem": "imagenet",
      "epochs": 90,
      "global_batch_size": 32768,
      "optimizer": "rmsprop_warmup",
      "base_lr": 0.1,
      "blend_center": 10.0,
      "blend_period": 5.0,
      "label_smoothing": 0.1,
      "sync_bn": True,
      "bn_momentum": 0.0,
      "wire_dtype": "float16",
      "workdir": "runs/imagenet-15min",
  }
