"""The in-step path: collectives traced into a jitted step (docs/design/overview.md)."""
