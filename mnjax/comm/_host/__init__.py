"""The host path: rounds outside any trace (the agreement record, the departure-aware wait,
transport in countable pieces, ChainerMN's host collectives, `broadcast` and exact sums)."""
