"""Akiba et al.'s 32k-batch recipe scaled down to the offline 8x8 digits: ResNet-18 (CIFAR
stem, synchronized BN without moving averages), 256 images per step (5 steps per epoch over
the 1,438 training images), SGD's rate ``eta = 1.6`` from the slow start (``base_lr 3.2``:
0.5 x 3.2 x 256/256, 16 times the linear-scaling rate of this batch), the RMSprop warm-up
blending into SGD on the ELU-shaped curve with centre 3 and period 2 epochs (SGD's share 0.9%
at the start, half at epoch 3, all of it from epoch 4), 7 epochs:

    python experiments/imagenet.py --config akiba_digits

Against plain momentum SGD (0.9, the same weight decay) at the same rate from the first step:

    python experiments/imagenet.py --config akiba_digits --optimizer goyal --warmup_epochs 0 \\
        --base_lr 1.6 --workdir runs/akiba-digits-sgd

Measured on this project's 2-core CPU machine (shared with other jobs, load 7-10), one
process, test loss / top-1 after each epoch:

    epoch                 1           2           3           4           5           6           7
    warm-up      1.06 68.5%  0.27 92.8%  0.39 91.9%  0.14 95.5%  0.26 95.0%  0.19 96.1%  0.40 93.0%
    momentum SGD 30417 10.0%  257 12.5%  11.0 14.5%  36.3 17.0%  2.18 26.7%  3.36 21.2%  2.20 26.2%

The warm-up run took 5 min 4 s, the SGD run 5 min 55 s (20-86 img/s: the load; 109 img/s on
an idle machine, about 2 min per run). Plain SGD's loss explodes in the first epoch and its
training accuracy stays near chance (16-24%); the warm-up run trains. The warm-up does not
make any rate safe: at ``--base_lr 6.4 --blend_center 4`` (eta 3.2) it trained to 94% by
epoch 5 and then diverged once SGD had the whole step (test loss 9229 at epoch 6).
"""


def get_config() -> dict:
  return {
      "dataset": "digits",
      "model": "resnet18",
      "stem": "cifar",
      "epochs": 7,
      "global_batch_size": 256,
      "optimizer": "rmsprop_warmup",
      "base_lr": 3.2,
      "blend_center": 3.0,
      "blend_period": 2.0,
      "bn_momentum": 0.0,
      "workdir": "runs/akiba-digits",
  }
