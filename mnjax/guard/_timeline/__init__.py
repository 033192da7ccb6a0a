"""The timeline, host side: `Timeline` and what it is built from.

The in-step half, the spans each collective's handler records, is
`mnjax.comm._instep._recorder`; the viewer is `lab.timeline`.
"""

from mnjax.guard._timeline._recording import ENV, Timeline, from_env, last_report

__all__ = ["ENV", "Timeline", "from_env", "last_report"]
