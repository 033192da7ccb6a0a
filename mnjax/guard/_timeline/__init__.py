"""The timeline's host side: `Timeline` and what it is built from (the in-step half is
`mnjax.comm._instep._recorder`, the viewer `lab.timeline`)."""

from mnjax.guard._timeline._recording import ENV, Timeline, from_env, last_report

__all__ = ["ENV", "Timeline", "from_env", "last_report"]
