"""A cluster on one box: emulated nodes (network + UTS namespaces) joined by shaped veth links.

``python -m lab.cluster run --nodes 2 --rate 1gbit --ranks-per-node 2 -- python train.py``
runs one MPI job across the nodes; ``up``/``down`` build and remove a cluster by hand.
Needs root (docs/design/cluster.md).

    >>> from lab import cluster
    >>> cluster.rate_bits("1gbit")
    1000000000.0
"""

from lab.cluster._launch import NETWORK_ENV, command, job_env, run
from lab.cluster._net import (
    MAX_NODES,
    PREFIX,
    Cluster,
    ClusterError,
    burst_bytes,
    check_available,
    down,
    rate_bits,
    sweep_orphans,
    up,
)

__all__ = ["MAX_NODES", "NETWORK_ENV", "PREFIX", "Cluster", "ClusterError", "burst_bytes",
           "check_available", "command", "down", "job_env", "rate_bits", "run", "sweep_orphans",
           "up"]
