"""experiments/imagenet.py on tfds.testing.mock_data (run by tests/jobs/test_imagenet_job.py).

Prints one line per rank, ``DIGEST <sha256 of params and batch statistics>``, so the test
can check that every rank ends with the same replica.

MPI starts first, before jax and tensorflow-datasets fill the heap, as in experiments/imagenet.py:
docs/design/launchers.md, "MPI before jax", says why the order matters under srun.
"""

from mpi4py import MPI  # noqa: F401

# isort: split
import hashlib
import os
import sys
from pathlib import Path

import jax
import numpy as np
import tensorflow_datasets as tfds

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import imagenet

import mnjax

if __name__ == "__main__":
  config = imagenet.parse_args(sys.argv[1:])
  comm = mnjax.create_communicator(config.comm)
  with tfds.testing.mock_data(num_examples=int(os.environ.get("MNJAX_MOCK_EXAMPLES", "32"))):
    state, _ = imagenet.train_and_evaluate(config, comm)
  assert state.batch_stats is not None  # a ResNet's state carries its BN statistics
  leaves = jax.tree.leaves((state.params, state.batch_stats))
  digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in leaves)).hexdigest()
  print(f"DIGEST rank {comm.rank} {digest}", flush=True)
