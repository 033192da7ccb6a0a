"""``python -m lab.timeline view TRACE [--steps 3] [--first STEP] [--out PNG]``."""

import argparse
import sys

from lab.timeline._view import render


def main(argv: list[str]) -> None:
  p = argparse.ArgumentParser(prog="python -m lab.timeline",
                              description="Draw a trace of mnjax.guard.Timeline as a PNG.")
  sub = p.add_subparsers(dest="command", required=True)
  view = sub.add_parser("view", help="a row per rank: compute / wait / exchange, per step")
  view.add_argument("trace", help="the trace JSON (MNJAX_TIMELINE's path)")
  view.add_argument("--steps", type=int, default=3, help="how many consecutive steps")
  view.add_argument("--first", type=int, default=None,
                    help="the first step drawn (default: the second step kept, past compilation)")
  view.add_argument("--out", default=None, help="the PNG (default: TRACE with .png)")
  args = p.parse_args(argv)
  out = render(args.trace, steps=args.steps, first=args.first, out=args.out)
  print(f"lab.timeline: {out}")


if __name__ == "__main__":
  main(sys.argv[1:])
