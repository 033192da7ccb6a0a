"""The in-step path: collectives traced into a jitted step (primitives, native handlers,
buckets, the order chain, the 16-bit wire, reduce-scatter, the timeline's markers)."""
