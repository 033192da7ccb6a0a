"""``python -m mnjax.bench {allreduce,step,kinds,resnet,checks,scaling,gpu,zero,aot,cluster}
[--options]``.

``--help`` per benchmark.
"""

import sys

BENCHMARKS = {
    "allreduce": "mnjax.bench.allreduce",
    "step": "mnjax.bench.step",
    "kinds": "mnjax.bench.kinds",
    "resnet": "mnjax.bench.resnet",
    "checks": "mnjax.bench.checks",
    "scaling": "mnjax.bench.scaling",
    "gpu": "mnjax.bench.gpu",
    "zero": "mnjax.bench.zero",
    "aot": "mnjax.bench.aot",
    "cluster": "mnjax.bench.cluster",
}


def main(argv: list[str]) -> None:
  if not argv or argv[0] not in BENCHMARKS:
    names = ", ".join(BENCHMARKS)
    sys.exit(f"usage: python -m mnjax.bench {{{names}}} [options]; got {argv[:1] or 'nothing'}")
  import importlib

  importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
  main(sys.argv[1:])
