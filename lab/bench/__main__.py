"""``python -m lab.bench {allreduce,step,kinds,resnet,checks,scaling,gpu,zero,aot,cluster}
[--options]``.

``--help`` per benchmark.
"""

import sys

BENCHMARKS = {
    "allreduce": "lab.bench.allreduce",
    "step": "lab.bench.step",
    "kinds": "lab.bench.kinds",
    "resnet": "lab.bench.resnet",
    "checks": "lab.bench.checks",
    "scaling": "lab.bench.scaling",
    "gpu": "lab.bench.gpu",
    "zero": "lab.bench.zero",
    "aot": "lab.bench.aot",
    "cluster": "lab.bench.cluster",
}


def main(argv: list[str]) -> None:
  if not argv or argv[0] not in BENCHMARKS:
    names = ", ".join(BENCHMARKS)
    sys.exit(f"usage: python -m lab.bench {{{names}}} [options]; got {argv[:1] or 'nothing'}")
  import importlib

  importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
  main(sys.argv[1:])
