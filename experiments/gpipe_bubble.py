"""The GPipe bubble, measured: one stage per rank, M micro-batches, against (S-1)/(M+S-1).

    mpirun -n 2 python experiments/gpipe_bubble.py          # ~2 min on 2 CPU cores

S = comm.size equal stages (each ``--layers`` Dense(``--width``) + relu) on ranks 0..S-1;
micro-batches of ``--micro_size`` examples, M in ``--micro_batches``, so the batch grows
with M. Two measurements of each rank's idle fraction:

* by timing: ``1 - M x t / T(M)``, with t one micro-batch's forward + backward through this
  rank's stage alone (jitted, no messages) and T(M) the pipelined step (median of
  ``--repeats``, ranks lined up by a barrier before each);
* by counting: the programs the step runs, executed by `mnjax.model_parallel.simulate` with
  the measured stage costs (idle time in the executed schedule).

Rank 0 prints one line per M (JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import mnjax
import mnjax.functions
from mnjax.model_parallel import MultiNodeChain, bubble_fraction, idle_fraction, programs, simulate


class Block(nn.Module):
  width: int
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.relu(nn.Dense(self.width)(x))
    return x


def median_time(fn, repeats, comm):
  times = []
  for _ in range(repeats):
    comm.mpi_comm.Barrier()
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--micro_size", type=int, default=128)
  p.add_argument("--micro_batches", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  comm = mnjax.create_communicator()
  stages = [(Block(args.width, args.layers), r) for r in range(comm.size)]
  loss_fn = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
  key = jax.random.key(0)
  one = jax.random.normal(key, (args.micro_size, args.width))
  module = stages[comm.rank][0]
  variables = module.init(key, one)
  forward = jax.jit(lambda v, x: module.apply(v, x))
  both = jax.jit(jax.grad(lambda v, x: jnp.sum(module.apply(v, x) * x)))
  jax.block_until_ready((forward(variables, one), both(variables, one)))
  t_f = median_time(lambda: forward(variables, one), args.repeats, comm)
  t_fb = median_time(lambda: both(variables, one), args.repeats, comm)
  costs = comm.mpi_comm.allgather((t_f, t_fb - t_f))
  for m in args.micro_batches:
    chain = MultiNodeChain(comm, stages, micro_batches=m)
    params = chain.init(key, jnp.zeros((m * args.micro_size, args.width)))
    x = jax.random.normal(jax.random.key(1), (m * args.micro_size, args.width))
    step = mnjax.functions.jit(
        lambda p, x, y, chain=chain: jax.grad(chain.loss)(p, x, y, loss_fn), comm)
    jax.block_until_ready(step(params, x, x))  # compile
    total = median_time(lambda step=step, params=params, x=x: step(params, x, x),
                        args.repeats, comm)
    whole = MultiNodeChain(comm, stages)  # the same batch without micro-batches
    plain = mnjax.functions.jit(
        lambda p, x, y, chain=whole: jax.grad(chain.loss)(p, x, y, loss_fn), comm)
    jax.block_until_ready(plain(params, x, x))
    sequential = median_time(lambda plain=plain, params=params, x=x: plain(params, x, x),
                             args.repeats, comm)
    timed = 1.0 - m * t_fb / total
    everyone = comm.mpi_comm.gather((timed, total, sequential), root=0)
    run = simulate(programs(chain.stage_ranks, m), chain.stage_ranks,
                   costs={"F": [c[0] for c in costs], "B": [c[1] for c in costs]})
    if comm.is_root:
      row = {"stages": comm.size, "micro_batches": m, "formula": bubble_fraction(comm.size, m),
             "counted_unit_costs": idle_fraction(simulate(programs(chain.stage_ranks, m),
                                                          chain.stage_ranks)),
             "counted_measured_costs": idle_fraction(run),
             "timed_per_rank": [round(t, 4) for t, _, _ in everyone],
             "step_s": round(max(t for _, t, _ in everyone), 5),
             "unpipelined_step_s": round(max(t for _, _, t in everyone), 5),
             "ideal_speedup": comm.size * m / (m + comm.size - 1),
             "stage_f_b_s": [[round(f, 5), round(b, 5)] for f, b in costs]}
      print(json.dumps(row) if args.json else
            f"S={comm.size} M={m}: formula {row['formula']:.3f}, counted"
            f" {row['counted_unit_costs']:.3f} (measured costs"
            f" {row['counted_measured_costs']:.3f}), timed {row['timed_per_rank']}; step"
            f" {row['step_s'] * 1e3:.1f} ms, unpipelined {row['unpipelined_step_s'] * 1e3:.1f} ms"
            f" (ideal speedup {row['ideal_speedup']:.2f}); stage F, B"
            f" {[[round(c * 1e3, 2) for c in fb] for fb in row['stage_f_b_s']]} ms", flush=True)


if __name__ == "__main__":
  main()
