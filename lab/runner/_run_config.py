"""`RunConfig`: the settings the training loop and every experiment share.

An experiment's config dataclass subclasses it with its own fields (see
`lab.runner.parse_flags`); `lab.runner.train_loop` reads it, and ``config.json`` records
it. Every field is checked when the config is built (`check_fields` and the checks of the
flags that name a signal, a wire dtype, a bucket size or a profile window), not when the
loop reaches it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lab.runner._flags import check_fields, flag
from lab.runner._preemption import parse_signals
from lab.runner._profile import profile_window
from mnjax.comm._communicator import KINDS
from mnjax.comm._instep._buckets import bucket_bytes_from_mb
from mnjax.comm._instep._wire import check_wire_dtype

__all__ = ["RunConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """The settings every experiment shares: the communicator, the gradient exchange, the
  data order and the loop's guards and checkpoints. Written to ``config.json``.

  Subclass it (``@dataclasses.dataclass(frozen=True, kw_only=True)``) with the
  experiment's fields; ``resume_settings`` names the fields a resumed run must keep.

  Example:
    >>> config = RunConfig(epochs=2, global_batch_size=64, workdir="runs/x")
    >>> config.checkpoint_every, config.stall_timeout
    (1, 300.0)
  """

  # Fields that fix the data order and the optimizer: a resumed run must keep them.
  resume_settings: ClassVar[tuple[str, ...]] = ("global_batch_size", "seed")

  epochs: int = flag(minimum=1, help="train until this epoch (resumed runs: the rest)")
  global_batch_size: int = flag(minimum=1, help="examples per step over all replicas")
  workdir: str = flag(help="config.json, metrics.jsonl, checkpoints/ go here (rank 0)")
  seed: int = flag(0, help="initialisation and data order")
  comm: str = flag("auto", choices=("auto", *KINDS),
                   help="communicator kind; auto: xla on GPUs, flat on CPUs")
  replicas: int = flag(0, minimum=0, help="the job's replica count, whatever the number of"
                       " processes (which must divide it): the same bits on any of them"
                       " (exact sums; --comm auto: hierarchical); 0: one per device")
  wire_dtype: str = flag("float32", help="gradients cross processes in this dtype (float32,"
                         " bfloat16 or float16)")
  bucket_mb: str = flag("auto", help="largest fused gradient buffer in MiB; auto: the"
                        " platform default; 0: one buffer per dtype")
  double_buffering: bool = flag(False, help="apply the previous step's reduced gradients"
                                " while this step's wait (ChainerMN's double buffering)")
  local_sgd: int = flag(0, minimum=0, help="local SGD: each replica steps on its own"
                        " gradient and the replicas meet every K steps and at every epoch's"
                        " end (mnjax.optim.local_sgd); 0: every step")
  shard_optimizer: bool = flag(False, help="ZeRO-1: each rank keeps 1/P of the optimizer"
                               " state (mnjax.shard_optimizer; kind flat)")
  progress: bool = flag(True, help="rank 0 shows a progress bar")
  resume: bool = flag(False, help="continue from the newest intact checkpoint in"
                      " <workdir>/checkpoints")
  checkpoint_every: int = flag(1, minimum=0, help="epochs between checkpoints; 0: never")
  checkpoint_steps: int = flag(0, minimum=0, help="also checkpoint every N steps; 0: at"
                               " epoch ends only")
  keep_checkpoints: int = flag(3, minimum=1, help="checkpoints kept")
  max_consecutive_skips: int = flag(10, minimum=0, help="steps with NaN/Inf gradients"
                                    " skipped in a row before the run fails")
  stall_timeout: float = flag(300.0, minimum=0, help="watchdog: seconds ranks may drift"
                              " apart; 0 disables it")
  baseline_workdir: str = flag("", help="a 1-rank run of the same config: report the"
                               " parallel efficiency against it")
  checkpoint_on_signal: str = flag("TERM,USR1", help="signals that make the run checkpoint"
                                   " and stop (Slurm's scancel, --signal); '' for none")
  tensorboard: str = flag("auto", help="TensorBoard scalars of every epoch (rank 0) in this"
                          " directory; auto: <workdir>/tensorboard; '' for none")
  profile_steps: str = flag("", help="jax.profiler trace into <workdir>/profile/rank<r>: N"
                            " steps from the run's second step, or global steps A:B (A .. B-1);"
                            " '' for none")

  def __post_init__(self):
    check_fields(self)
    check_wire_dtype(self.wire_dtype, "--wire_dtype")
    parse_signals(self.checkpoint_on_signal)
    profile_window(self.profile_steps)
    bucket_bytes_from_mb(self.bucket_mb)
    if self.local_sgd:
      clash = [f"--{name}" for name in ("shard_optimizer", "double_buffering", "replicas",
                                        "checkpoint_steps") if getattr(self, name)]
      if clash:
        raise ValueError(
            f"--local_sgd {self.local_sgd} cannot be combined with {', '.join(clash)}: the"
            " replicas differ between meetings (no exact sums over them, no mid-epoch"
            " checkpoint; they meet at every epoch's end, where the checkpoint is), and"
            " local SGD exchanges nothing in between. Drop one of them.")
    if self.shard_optimizer and self.double_buffering:
      raise ValueError(
          "--shard_optimizer and --double_buffering cannot be combined: the sharded optimizer"
          " exchanges inside its own update (reduce-scatter, then all-gather). Pick one.")
