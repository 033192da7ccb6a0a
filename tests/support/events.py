"""TensorBoard event files read back with TensorBoard's own reader (no TensorFlow)."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """``{tag: [(step, value), ...]}`` of the event files in `logdir`, as TensorBoard shows
  them (a later file's purge step hides the earlier files' events from that step on)."""
  events = EventAccumulator(str(logdir))
  events.Reload()
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
          for tag in events.Tags()["scalars"]}
