"""The linear scaling rule (Goyal et al. 2017): the learning rate grows with the batch."""


def linear_scaling(global_batch_size: int, base_lr: float = 0.1,
                   base_batch_size: int = 256) -> float:
  """The linear scaling rule: ``base_lr x global_batch_size / base_batch_size``.

  Example:
    >>> linear_scaling(8192)
    3.2
  """
  if global_batch_size < 1 or base_batch_size < 1:
    raise ValueError(
        f"linear_scaling: batch sizes must be >= 1, got global {global_batch_size},"
        f" base {base_batch_size}.")
  return base_lr * global_batch_size / base_batch_size
