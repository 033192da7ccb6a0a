"""The README's Slurm lines on a real Slurm: Debian's slurm-wlm with two slurmd nodes on this
host (scripts/slurm.sh), srun through PMI-2 (MpiDefault=pmi2: what the mpich wheel and
Debian's Slurm share) of experiments/train.py and experiments/imagenet.py (mocked data),
bad launches (srun --mpi=none, more tasks per node than cores), sbatch of
scripts/train.sbatch, and preemption as clusters do it (scancel, scontrol requeue, --signal).
Skipped where Slurm cannot run (not installed, or not root: the main suite on a fresh
machine; scripts/ci_cluster_launchers.sh installs it and runs this file).
docs/design/launchers.md says what each case proves."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
from support.launch import REPO, run_mpi, xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

SLURM = REPO / "scripts" / "slurm.sh"
EPOCHS = 8
FLAGS = ["--epochs", str(EPOCHS), "--no-progress"]
TRAIN = [sys.executable, "experiments/train.py"]


@pytest.fixture(scope="module")
def cluster():
  """The environment that reaches the cluster (``SLURM_CONF``); brought up for this module
  and down after it unless it was up before."""
  if shutil.which("slurmctld") is None or os.geteuid() != 0:
    pytest.skip("needs Slurm installed and root (the daemons run as root): run"
                " scripts/slurm.sh up as root first (it installs Debian's slurm-wlm), or"
                " scripts/ci_cluster_launchers.sh")
  was_up = subprocess.run([SLURM, "status"], capture_output=True).returncode == 0
  up = subprocess.run([SLURM, "up"], capture_output=True, text=True, timeout=900)
  if up.returncode != 0:
    pytest.skip(f"scripts/slurm.sh up failed here: {up.stderr[-3000:]}")
  conf = re.search(r"export SLURM_CONF=(\S+)", subprocess.run(
      [SLURM, "env"], capture_output=True, text=True).stdout).group(1)
  # A job's own SLURM_* (pytest run inside an allocation) must not leak into these jobs.
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  yield {**env, "SLURM_CONF": conf}
  if not was_up:
    subprocess.run([SLURM, "down"], capture_output=True, timeout=300)


PMI2_GARBLED = "mpi/pmi2: invalid client request"  # slurmstepd, on a garbled PMI-2 request


def slurm(cluster, *cmd, timeout=60):
  """A Slurm client command (squeue, scontrol, scancel) -> its stdout."""
  out = subprocess.run(cmd, env=cluster, capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, f"{cmd}: {out.stderr}"
  return out.stdout


def start(cluster, cmd):
  """Starts `cmd` (srun/sbatch ...) from the repository root, output merged."""
  return subprocess.Popen(cmd, cwd=REPO, env=cluster, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(cluster, proc, name, timeout):
  """Waits for `proc`; after `timeout` s cancels job `name`, kills it, fails with the output.
  A job whose MPI_Init died on a garbled PMI-2 request (`PMI2_GARBLED`) is ended 20 s later
  instead (its other tasks would wait in MPI_Init until the timeout): rc -9, its output."""
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  deadline, garbled_at = time.monotonic() + timeout, None
  while proc.poll() is None:
    now = time.monotonic()
    if garbled_at is None and any(PMI2_GARBLED in line for line in list(lines)):
      garbled_at = now
    if now > deadline or (garbled_at is not None and now - garbled_at > 20):
      subprocess.run(["scancel", "--name", name], env=cluster, timeout=30)
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      reader.join(timeout=10)
      out = "".join(lines)
      if garbled_at is not None:
        return -9, out
      raise AssertionError(f"{proc.args} did not finish in {timeout} s. Output:\n{out}")
    time.sleep(0.5)
  reader.join(timeout=30)
  return proc.returncode, "".join(lines)


def srun(cluster, args, *, timeout=300, layout=("-N", "2", "-n", "2")):
  """`srun` of `args` -> (rc, output). Known, not understood (docs/design/launchers.md, "Not
  done"): now and then slurmstepd receives text that is not a PMI-2 request and MPI_Init fails
  before mnjax runs; such a launch is tried once more (a second failure is the result)."""
  for attempt in range(2):
    name = f"mnjax-{uuid.uuid4().hex[:8]}"
    rc, out = finish(cluster, start(cluster, ["srun", "-J", name, *layout, *args]), name,
                     timeout)
    if rc == 0 or PMI2_GARBLED not in out or attempt == 1:
      return rc, out
  raise AssertionError("unreachable")


class Garbled(AssertionError):
  """A batch job's MPI_Init died on a garbled PMI-2 request (`PMI2_GARBLED` in its log)."""


def wait_for_epoch(workdir, proc, timeout=240, log=None):
  """Returns once `workdir` holds an epoch's record (the job is training); with the job's
  `log`, raises `Garbled` 20 s after the log shows `PMI2_GARBLED` with no record yet."""
  deadline, garbled_at = time.monotonic() + timeout, None
  while time.monotonic() < deadline:
    if (workdir / "metrics.jsonl").exists() and (workdir / "metrics.jsonl").read_text():
      return
    assert proc is None or proc.poll() is None, proc.communicate()[0][-5000:]
    if garbled_at is None and log is not None and log.exists() and (
        PMI2_GARBLED in log.read_text(errors="replace")):
      garbled_at = time.monotonic()
    if garbled_at is not None and time.monotonic() - garbled_at > 20:
      raise Garbled(log.read_text(errors="replace")[-3000:])
    time.sleep(0.2)
  raise AssertionError(f"no epoch record in {workdir} after {timeout} s")


def submit_training(cluster, workdir, log, *args):
  """``sbatch --parsable --output=LOG ARGS``, then `wait_for_epoch`; returns the job id. A job
  whose MPI_Init died on a garbled PMI-2 request (as `srun` retries) is cancelled and
  submitted once more, into a clean work directory."""
  for attempt in range(2):
    job = slurm(cluster, "sbatch", "--parsable", f"--output={log}", *args).strip()
    try:
      wait_for_epoch(workdir, None, log=log)
      return job
    except Garbled:
      subprocess.run(["scancel", job], env=cluster, timeout=30)
      if attempt == 1:
        raise
    except AssertionError as e:  # say why: pending (and its reason) or running without output
      shown = subprocess.run(["scontrol", "show", "job", job], env=cluster, capture_output=True,
                             text=True, timeout=30).stdout
      subprocess.run(["scancel", job], env=cluster, timeout=30)
      tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no job log)"
      raise AssertionError(f"{e}\n{shown}\n{tail}") from None
    deadline = time.monotonic() + 60  # the garbled job, cancelled: gone before the next
    while job_state(cluster, job) in ("PENDING", "RUNNING", "COMPLETING") and (
        time.monotonic() < deadline):
      time.sleep(0.5)
    shutil.rmtree(workdir, ignore_errors=True)
    log.unlink(missing_ok=True)
  raise AssertionError("unreachable")


def assert_bitwise(a_dir, b_dir):
  a, b = np.load(a_dir / "params.npz"), np.load(b_dir / "params.npz")
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
  """The main job, uninterrupted, under srun on two nodes."""
  workdir = tmp_path_factory.mktemp("slurm") / "reference"
  rc, out = srun(cluster, [*TRAIN, *FLAGS, "--workdir", str(workdir)])
  assert rc == 0, out[-5000:]
  assert "2 rank(s) on 2 node(s)" in out and "final test accuracy" in out
  return workdir


def test_srun_trains_the_same_parameters_as_mpirun(cluster, reference, tmp_path):
  # Two ranks: a sum of two float32 values does not depend on which rank adds, so MPICH's
  # choice of algorithm (it sees 2 nodes under srun, 1 under mpirun) cannot change a bit.
  result = run_mpi(2, ["experiments/train.py", *FLAGS, "--workdir", str(tmp_path)],
                   timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  assert_bitwise(reference, tmp_path)


def test_the_readme_srun_line_runs_as_written(cluster, reference, tmp_path):
  # README: srun -N N --ntasks-per-node=8 --cpu-bind=cores python experiments/train.py
  # (no --mpi: MpiDefault); here 2 nodes x 1 task, the flat kind on CPUs.
  rc, out = srun(cluster, [*TRAIN, *FLAGS, "--workdir", str(tmp_path)],
                 layout=("-N", "2", "--ntasks-per-node=1", "--cpu-bind=cores"))
  assert rc == 0, out[-5000:]
  assert_bitwise(reference, tmp_path)


def test_srun_with_comm_xla_trains_the_same_parameters(cluster, reference, tmp_path):
  # jax.distributed under srun: the coordinator chosen by mnjax over MPI and checked from
  # every rank (mnjax/comm/_coordinator.py), gloo between the tasks. One device per task:
  # two float32 values per sum, as the flat reference, so bitwise equal.
  env = {**cluster, "XLA_FLAGS": xla_flags(1)}
  name = f"mnjax-{uuid.uuid4().hex[:8]}"
  proc = subprocess.Popen(
      ["srun", "-J", name, "-N", "2", "-n", "2", *TRAIN, *FLAGS, "--comm", "xla",
       "--workdir", str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, start_new_session=True)
  rc, out = finish(cluster, proc, name, timeout=300)
  assert rc == 0, out[-5000:]
  assert "2 rank(s) on 2 node(s) x 1 cpu device(s), kind xla" in out, out[-3000:]
  assert_bitwise(reference, tmp_path)


# experiments/imagenet.py on mocked CIFAR-10 (tests/support/imagenet_job_mocked.py prints a
# digest of each rank's parameters and BN statistics): ResNet-6 (two blocks) at 32 px, 16
# examples, 2 steps, no evaluation or checkpoint: the least that still runs the experiment's
# own loop.
IMAGENET = [sys.executable, "tests/support/imagenet_job_mocked.py", "--config",
            "resnet18_cifar10", "--model", "resnet6", "--global_batch_size", "8", "--epochs",
            "1", "--base_lr", "0.32", "--warmup_epochs", "0", "--no-eval", "--no-progress",
            "--checkpoint_every", "0"]
MOCKED = {"MNJAX_MOCK_EXAMPLES": "16"}


def digests(out):
  found = dict(re.findall(r"DIGEST rank (\d) ([0-9a-f]{64})", out))
  assert set(found) == {"0", "1"}, out[-5000:]
  return found


def test_imagenet_under_srun_ends_with_the_mpirun_parameters(cluster, tmp_path):
  # The README's second srun line. The two jobs share the session's compilation cache
  # (tests/conftest.py), so the ResNet compiles once.
  workdir = tmp_path / "srun"
  rc, out = srun({**cluster, **MOCKED}, [*IMAGENET, "--workdir", str(workdir)])
  assert rc == 0, out[-5000:]
  on_slurm = digests(out)
  assert on_slurm["0"] == on_slurm["1"], on_slurm  # one replica
  config = json.loads((workdir / "config.json").read_text())
  assert config["topology"]["size"] == 2 and config["topology"]["inter_size"] == 2, config
  result = run_mpi(2, [*IMAGENET[1:], "--workdir", str(tmp_path / "mpirun")], timeout=300,
                   env=MOCKED)
  assert result.returncode == 0, result.stdout[-5000:]
  assert digests(result.stdout) == on_slurm  # bitwise: two float32 per sum, as above


CREATE = [sys.executable, "-c", "import mnjax; mnjax.create_communicator('flat')"]


def test_srun_without_the_mpis_pmi_is_refused_on_every_task(cluster):
  # --mpi=none: MPICH finds no PMI, every task is a singleton (size 1) that would train
  # alone; mnjax compares with Slurm's task count and refuses on every task.
  rc, out = srun(cluster, ["--mpi=none", *CREATE], timeout=120)
  assert rc != 0
  assert out.count("the launcher started 2 processes (SLURM_STEP_NUM_TASKS=2), but MPI sees"
                   " 1") == 2, out[-5000:]


def test_more_tasks_per_node_than_cores_is_refused_by_slurm(cluster):
  # Slurm refuses the step before anything starts (no --overcommit); more tasks than GPUs
  # on a node is create_communicator's error (mnjax/comm/_devices.py, tests/unit).
  cpus = int(re.search(r"CPUTot=(\d+)", slurm(cluster, "scontrol", "show", "node", "n1")).group(1))
  rc, out = srun(cluster, [sys.executable, "-c", "print('started')"], timeout=60,
                 layout=("-N", "1", f"--ntasks-per-node={cpus + 1}"))
  assert rc != 0 and "started" not in out
  assert "CPU count per node can not be satisfied" in out, out


TOPOLOGY = """
import json, os, mnjax
comm = mnjax.create_communicator("flat")
env = {k: int(os.environ[k]) for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                       "SLURM_NODEID", "SLURM_NNODES")}
print("TOPOLOGY", json.dumps({**env, "rank": comm.rank, "size": comm.size,
      "intra_rank": comm.intra_rank, "intra_size": comm.intra_size,
      "inter_rank": comm.inter_rank, "inter_size": comm.inter_size}), flush=True)
"""


def test_the_communicators_nodes_are_slurms_nodes(cluster):
  # Two slurmd on one host: MPICH's node split follows the PMI's process mapping, i.e.
  # Slurm's nodes, not the host (the MPI_COMM_TYPE_SHARED split the communicator reads).
  rc, out = srun(cluster, [sys.executable, "-c", TOPOLOGY],
                 layout=("-N", "2", "--ntasks-per-node=2"))
  assert rc == 0, out[-5000:]
  rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
          if line.startswith("TOPOLOGY ")]
  assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
  for r in rows:
    assert r["rank"] == r["SLURM_PROCID"] and r["size"] == r["SLURM_NTASKS"] == 4, r
    assert r["intra_rank"] == r["SLURM_LOCALID"] and r["intra_size"] == 2, r
    assert r["inter_rank"] == r["SLURM_NODEID"] and r["inter_size"] == r["SLURM_NNODES"] == 2, r


def test_scancel_then_resume_equals_the_uninterrupted_run(cluster, reference, tmp_path):
  name = f"mnjax-{uuid.uuid4().hex[:8]}"
  proc = start(cluster, ["srun", "-J", name, "-N", "2", "-n", "2", *TRAIN, *FLAGS,
                         "--workdir", str(tmp_path)])
  wait_for_epoch(tmp_path, proc)
  slurm(cluster, "scancel", "--name", name)  # SIGTERM now, SIGKILL after KillWait
  rc, out = finish(cluster, proc, name, timeout=120)
  found = re.search(r"SIGTERM received: checkpointed at step (\d+)", out)
  assert rc != 0 and found and "final test accuracy" not in out, out[-5000:]
  assert not (tmp_path / "params.npz").exists()

  rc, out = srun(cluster, [*TRAIN, *FLAGS, "--workdir", str(tmp_path), "--resume"])
  assert rc == 0, out[-5000:]
  assert f"(step {found.group(1)})" in out, out[-3000:]  # from the signal's checkpoint
  assert_bitwise(reference, tmp_path)


def job_state(cluster, job):
  return re.search(r"JobState=(\S+)", slurm(cluster, "scontrol", "show", "job", job)).group(1)


def wait_until_ended(cluster, job, log, seconds):
  """Until `job` has ended (any final state), or fails with its log after `seconds`."""
  deadline = time.monotonic() + seconds
  while job_state(cluster, job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
    assert time.monotonic() < deadline, log.read_text()[-5000:]
    time.sleep(0.5)


def test_sbatch_of_the_example_script_requeued_resumes_by_itself(cluster, reference, tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "job.out"
  job = submit_training(cluster, workdir, log, "-N", "2", "--ntasks-per-node=1",
                        "scripts/train.sbatch", *FLAGS[:2], "--workdir", str(workdir))
  try:
    slurm(cluster, "scontrol", "requeue", job)  # what preemption with requeue does
    # A requeued job waits (BeginTime) before it may start again: start it now.
    deadline = time.monotonic() + 60
    while job_state(cluster, job) != "PENDING" and time.monotonic() < deadline:
      time.sleep(0.5)
    slurm(cluster, "scontrol", "update", f"JobId={job}", "StartTime=now")
    wait_until_ended(cluster, job, log, 300)
  finally:
    subprocess.run(["scancel", job], env=cluster, timeout=30)
  out = log.read_text()
  assert job_state(cluster, job) == "COMPLETED", out[-5000:]
  assert "attempt 0" in out and "attempt 1" in out, out[-5000:]
  assert "SIGTERM received: checkpointed at step" in out, out[-5000:]
  assert re.search(r"resuming at epoch \d+, batch \d+ \(step \d+\)", out), out[-5000:]
  assert_bitwise(reference, workdir)


def test_usr1_from_slurm_checkpoints_the_job_and_resume_finishes(cluster, tmp_path):
  # What `--signal=USR1@N` delivers before the time limit, sent now (`scancel --signal`) to
  # every task of the example batch job: the run checkpoints at the next step and stops.
  workdir, log = tmp_path / "run", tmp_path / "job.out"
  job = submit_training(cluster, workdir, log, "--no-requeue", "-N", "2",
                        "--ntasks-per-node=1", "scripts/train.sbatch", *FLAGS[:2],
                        "--checkpoint_every", "0", "--workdir", str(workdir))
  try:
    slurm(cluster, "scancel", "--signal=USR1", job)  # the tasks of its steps, not the shell
    wait_until_ended(cluster, job, log, 120)
  finally:
    subprocess.run(["scancel", job], env=cluster, timeout=30)
  out = log.read_text()
  found = re.search(r"SIGUSR1 received: checkpointed at step (\d+)", out)
  assert job_state(cluster, job) == "FAILED" and found, out[-5000:]  # exit code 138
  assert os.listdir(workdir / "checkpoints") == [found.group(1)]  # the only checkpoint
  rc, out = srun(cluster, [*TRAIN, *FLAGS, "--workdir", str(workdir), "--resume"])
  assert rc == 0 and f"(step {found.group(1)})" in out, out[-5000:]


def wait_for_an_empty_queue(cluster, seconds=120):
  """Until no job is queued or completing (the earlier tests' jobs hold the nodes until
  their processes are gone): a job submitted before then may wait for the scheduler."""
  deadline = time.monotonic() + seconds
  while slurm(cluster, "squeue", "--noheader").strip():  # pending, running, completing
    assert time.monotonic() < deadline, slurm(cluster, "squeue")
    time.sleep(0.5)


# More epochs than any machine trains before the cut limit ends the job (a digits epoch takes
# 0.1 s on a quiet CI machine: 200 epochs finished before the signal came): the job must still
# be training when USR1 arrives, and the limit (1-2 min) ends it if the signal never does.
LONG_EPOCHS = 100_000


def test_the_timed_usr1_of_the_example_script_checkpoints_before_the_limit(cluster, tmp_path):
  # scripts/train.sbatch asks for USR1 120 s before the time limit (--signal=USR1@120).
  # slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT) and sends the signal at the
  # first check where end - 120 s - 30 s <= now. Submitted with a 10 min limit, the window
  # opens once the job trains: the limit is then cut to end 1-2 min from now, so the next
  # check (at most 30 s later) sends USR1 to the tasks, well before the limit's SIGTERM.
  workdir, log = tmp_path / "run", tmp_path / "job.out"
  wait_for_an_empty_queue(cluster)
  job = submit_training(cluster, workdir, log, "--no-requeue", "--time=10", "-N", "2",
                        "--ntasks-per-node=1", "scripts/train.sbatch", "--epochs",
                        str(LONG_EPOCHS), "--checkpoint_every", "0", "--workdir", str(workdir))
  try:
    shown = slurm(cluster, "scontrol", "show", "job", job)
    run = [int(x) for x in re.search(r"RunTime=(\S+)", shown).group(1).split(":")]
    minutes = -(-(run[-3] * 3600 + run[-2] * 60 + run[-1]) // 60) + 1   # ends in 60-120 s
    slurm(cluster, "scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
    cut = time.monotonic()
    wait_until_ended(cluster, job, log, 150)
    took = time.monotonic() - cut
  finally:
    subprocess.run(["scancel", job], env=cluster, timeout=30)
  out = log.read_text()
  found = re.search(r"SIGUSR1 received: checkpointed at step (\d+)", out)
  assert found and job_state(cluster, job) == "FAILED", out[-5000:]   # not TIMEOUT
  assert took < 60, (took, out[-3000:])   # the next 30 s check, the step, the save
  assert os.listdir(workdir / "checkpoints") == [found.group(1)]


def rank_pids(workdir):
  """{rank: pid} of the processes running experiments/train.py in `workdir` (from /proc)."""
  found = {}
  for proc in os.listdir("/proc"):
    try:
      cmdline = open(f"/proc/{proc}/cmdline", "rb").read().split(b"\0")
      environ = open(f"/proc/{proc}/environ", "rb").read().split(b"\0")
    except OSError:
      continue
    if b"experiments/train.py" in cmdline and str(workdir).encode() in cmdline:
      for var in environ:
        if var.startswith(b"PMI_RANK="):
          found[int(var[9:])] = int(proc)
  return found


def test_sigterm_to_one_rank_under_mpirun_checkpoints_on_every_rank(tmp_path):
  # No Slurm needed (runs in the main suite): the signal reaches rank 1 only, every rank
  # agrees to stop at the same step, rank 0 writes the checkpoint, --resume continues.
  from support.launch import mpirun_path
  args = [mpirun_path(), "-n", "2", sys.executable, "experiments/train.py", *FLAGS,
          "--workdir", str(tmp_path)]
  proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  try:
    wait_for_epoch(tmp_path, proc)
    os.kill(rank_pids(tmp_path)[1], signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  found = re.search(r"SIGTERM received: checkpointed at step (\d+) \(epoch (\d+)", out)
  assert proc.returncode != 0 and found and "final test accuracy" not in out, out[-5000:]
  assert found.group(1) in os.listdir(tmp_path / "checkpoints")
  result = run_mpi(2, ["experiments/train.py", *FLAGS, "--workdir", str(tmp_path), "--resume"],
                   timeout=300)
  assert result.returncode == 0, result.stdout[-5000:]
  assert f"(step {found.group(1)})" in result.stdout and "final test accuracy" in result.stdout
