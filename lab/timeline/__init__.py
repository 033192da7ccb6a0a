"""Reading and drawing the traces `mnjax.guard.Timeline` writes.

``python -m lab.timeline view TRACE --steps 3`` renders a PNG: a row per rank, each
step's compute, wait (for the last peer) and exchange coloured (`render`). Recording lives
in `mnjax.guard.Timeline` (and ``MNJAX_TIMELINE=path`` for the train loop).
"""

from lab.timeline._view import load, render

__all__ = ["load", "render"]
