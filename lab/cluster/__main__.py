"""``python -m lab.cluster {up,down,run}``: the emulated cluster from the command line.

* ``up --nodes N --rate RATE [--tag T]``: builds it and prints how to reach it;
* ``down [--tag T]``: removes cluster T (every ``mnjaxc-`` namespace without a tag);
* ``run --nodes N --rate RATE [--ranks-per-node K] [--devices-per-rank D] [--bytes-json PATH]
  [--timeout S] -- CMD ...``: one MPI job of N x K ranks; exits with the job's code.
"""

from __future__ import annotations

import argparse
import sys

from lab.cluster._launch import run
from lab.cluster._net import PREFIX, ClusterError, down, up


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m lab.cluster")
  sub = p.add_subparsers(dest="action", required=True)
  u = sub.add_parser("up", help="build a cluster that stays until `down`")
  u.add_argument("--nodes", type=int, required=True)
  u.add_argument("--rate", required=True, help="tc rate per uplink and direction, or none")
  u.add_argument("--tag", default="u0")
  d = sub.add_parser("down", help="remove a cluster (all of them without --tag)")
  d.add_argument("--tag", default=None)
  r = sub.add_parser("run", help="one MPI job across a fresh cluster")
  r.add_argument("--nodes", type=int, required=True)
  r.add_argument("--rate", required=True)
  r.add_argument("--ranks-per-node", type=int, default=1)
  r.add_argument("--devices-per-rank", type=int, default=None)
  r.add_argument("--bytes-json", default=None)
  r.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
  r.add_argument("cmd", nargs=argparse.REMAINDER)
  return p


def main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.action == "up":
      c = up(args.nodes, args.rate, tag=args.tag)
      print(f"cluster {c.tag}: hub {c.hub} (mpirun runs there), nodes "
            + ", ".join(f"{c.node(i)}={c.address(i)}" for i in range(c.nodes))
            + f"; remove with: python -m lab.cluster down --tag {c.tag}")
      return 0
    if args.action == "down":
      gone = down(args.tag)
      print(f"removed {len(gone)} namespace(s) named {PREFIX}{args.tag or ''}*")
      return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return run(cmd, nodes=args.nodes, rate=args.rate, ranks_per_node=args.ranks_per_node,
               devices_per_rank=args.devices_per_rank, bytes_json=args.bytes_json,
               timeout=args.timeout)
  except ClusterError as e:
    print(f"lab.cluster: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    print(f"lab.cluster: interrupted ({e}); cluster removed", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
