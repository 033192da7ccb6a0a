"""Bad input to mnjax's collectives, as a new user would give it: one case per run.

    mpirun -n 2 python tests/support/adversarial.py CASE   # one case: a job that must fail
    python tests/support/adversarial.py --report [-n 2]    # every case, classified, counted

Each case makes the ranks disagree (another model, another root, another tree...) or one rank
finish early. The job must end quickly, with a non-zero exit and the same clear message on
every rank that is still running; `classify` sorts a run into ``clear`` (that),
``one rank`` (an error on some running ranks only), ``unclear`` (a raw error from below
mnjax), ``hang`` and ``silent`` (exit 0: bad input accepted). tests/jobs/test_adversarial.py
runs every case under mpirun -n 2 and some under -n 3.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

CASES: dict = {}


def case(fn):
  CASES[fn.__name__] = fn
  return fn


def _stack(comm, layers: int, width: int):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  import mnjax

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(layers):
        x = mnjax.SyncBatchNorm(comm, use_running_average=False)(nn.Dense(width)(x))
      return x

  model = Stack()
  x = jnp.ones((2, 5))
  return model, model.init(jax.random.key(0), x), x


def _forward_only(comm, layers: int, width: int, *, jit=None):
  import mnjax

  model, variables, x = _stack(comm, layers, width)
  fn = lambda v, x: model.apply(v, x, mutable=["batch_stats"])[1]
  step = jit(fn) if jit else mnjax.data_parallel(fn, comm)
  step(variables, x)


def _last(comm) -> bool:
  return comm.rank == comm.size - 1


@case
def sync_bn_one_more_layer(comm):
  _forward_only(comm, 3 if _last(comm) else 2, 4)


@case
def sync_bn_no_layer_on_one_rank(comm):
  _forward_only(comm, 0 if _last(comm) else 1, 4)


@case
def sync_bn_other_width(comm):
  _forward_only(comm, 2, 6 if _last(comm) else 4)


@case
def sync_bn_under_plain_jit(comm):
  import jax
  _forward_only(comm, 2, 4, jit=jax.jit)


@case
def broadcast_other_root(comm):
  import numpy as np

  import mnjax
  mnjax.broadcast({"w": np.full(4, comm.rank, np.float32)}, comm, root=comm.rank)


@case
def broadcast_other_root_large(comm):
  import numpy as np

  import mnjax
  mnjax.broadcast({"w": np.zeros(4_000_000, np.float32)}, comm, root=comm.rank)


@case
def broadcast_list_and_tuple(comm):
  import numpy as np

  import mnjax
  leaves = [np.zeros(3, np.float32), np.ones(2, np.float32)]
  mnjax.broadcast(tuple(leaves) if _last(comm) else leaves, comm)


@case
def metrics_other_keys(comm):
  import numpy as np

  import mnjax
  metrics = {"loss": np.float32(1.0), "accuracy" if _last(comm) else "acc": np.float32(0.5)}
  mnjax.allreduce_metrics(metrics, comm)


@case
def persistent_other_shape(comm):
  import numpy as np

  import mnjax
  mnjax.nn.allreduce_persistent({"mean": np.zeros(4 if _last(comm) else 3, np.float32)}, comm)


@case
def gradients_other_shape(comm):
  import jax
  import jax.numpy as jnp

  import mnjax
  tx = mnjax.allreduce_gradients(comm)
  grads = {"w": jnp.ones((10, 64) if _last(comm) else (64, 10))}
  jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads)


@case
def batch_argnums_past_the_arguments(comm):
  import jax.numpy as jnp

  import mnjax
  mnjax.data_parallel(lambda a, b: a + b, comm, batch_argnums=(5,))(jnp.ones(2), jnp.ones(2))


@case
def epoch_batches_empty(comm):
  import mnjax
  list(mnjax.epoch_batches(0, comm, comm.size, shuffle=True))


@case
def epoch_batches_seed_per_rank(comm):
  import mnjax
  list(mnjax.epoch_batches(64, comm, 2 * comm.size, shuffle=True, seed=comm.rank))


@case
def learning_rate_per_rank(comm):
  import jax
  import jax.numpy as jnp
  import optax

  import mnjax
  tx = optax.chain(mnjax.allreduce_gradients(comm), optax.adam(1e-2 * (1 + comm.rank)))

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = jnp.ones((3, 2))
  mnjax.data_parallel(step, comm, batch_argnums=(2,))(params, tx.init(params), jnp.ones((2, 3)))


@case
def one_rank_leaves_during_broadcast(comm):
  import numpy as np

  import mnjax
  if _last(comm):
    return  # finishes normally: the others must not wait for it
  time.sleep(0.5)
  mnjax.broadcast({"w": np.zeros(3, np.float32)}, comm)


def main(name: str) -> None:
  import mnjax

  comm = mnjax.create_communicator("flat")
  CASES[name](comm)
  print(f"rank {comm.rank}: returned normally", flush=True)


# -- classification (no jax needed) -----------------------------------------------------------

_ERROR = re.compile(r"^\[rank (\d+)\] (\w+(?:Error|Exception)): (.*)$", re.M)


def errors_by_rank(output: str) -> dict[int, str]:
  """The last exception line each rank printed through mnjax's abort-on-error hook."""
  return {int(rank): f"{kind}: {text}" for rank, kind, text in _ERROR.findall(output)}


def classify(returncode: int | None, output: str, ranks: int, leaving: int = 0) -> str:
  """``clear``, ``one rank``, ``unclear``, ``hang`` or ``silent`` (see the module docstring);
  `leaving`: how many ranks finish normally on purpose (they print nothing)."""
  if returncode is None:
    return "hang"
  if returncode == 0:
    return "silent"
  errors = errors_by_rank(output)
  if not errors or any(not text.split(": ", 1)[1].startswith(_MNJAX_PREFIXES)
                       and "mnjax" not in text for text in errors.values()):
    return "unclear"
  if len(errors) < ranks - leaving or len({t.split(": ", 1)[1] for t in errors.values()}) > 1:
    return "one rank"
  return "clear"


# Messages mnjax raises start with the public name of the call that raised.
_MNJAX_PREFIXES = ("SyncBatchNorm", "broadcast", "allreduce", "data_parallel", "scatter_index",
                   "epoch_batches", "rank ")
LEAVING = {"one_rank_leaves_during_broadcast": 1}


def report(ranks: int, timeout: float = 60.0) -> dict[str, str]:
  import subprocess
  repo = Path(__file__).resolve().parents[2]
  sys.path.insert(0, str(repo / "tests"))
  from support.launch import mpirun_path

  results = {}
  for name in CASES:
    start = time.monotonic()
    try:
      done = subprocess.run([mpirun_path(), "-n", str(ranks), sys.executable, __file__, name],
                            cwd=repo, capture_output=True, text=True, timeout=timeout)
      rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
      rc, out = None, ""
    results[name] = classify(rc, out, ranks, LEAVING.get(name, 0))
    print(f"{name:36s} {results[name]:9s} {time.monotonic() - start:5.1f} s", flush=True)
  counts = {kind: list(results.values()).count(kind)
            for kind in ("clear", "one rank", "unclear", "hang", "silent")}
  print(f"{len(results)} cases at {ranks} ranks: {counts}")
  return results


if __name__ == "__main__":
  if sys.argv[1] == "--report":
    report(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
  else:
    main(sys.argv[1])
