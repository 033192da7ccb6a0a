"""`create_communicator`'s launcher check (mnjax/comm/_launcher.py): a launcher that started
several processes while MPI's world has one (every process a singleton) is refused, naming
the launcher's variable and the fix; a job whose size agrees, or no launcher, passes."""

import pytest

from mnjax.comm import _launcher as launcher

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."


@pytest.mark.parametrize(("environ", "found"), [
    ({"OMPI_COMM_WORLD_SIZE": "2", "PMI_SIZE": "9", "SLURM_STEP_NUM_TASKS": "9"},
     ("OMPI_COMM_WORLD_SIZE", 2)),  # the most specific launcher first
    ({"PMI_SIZE": "3", "SLURM_STEP_NUM_TASKS": "9"}, ("PMI_SIZE", 3)),
    ({"SLURM_STEP_NUM_TASKS": "4"}, ("SLURM_STEP_NUM_TASKS", 4)),
    ({"PMI_SIZE": "", "SLURM_STEP_NUM_TASKS": "x"}, None),  # not numbers: no launcher
    ({}, None),
])
def test_launched_size_reads_the_most_specific_launcher(environ, found):
  assert launcher.launched_size(environ) == found


@pytest.mark.parametrize(("world", "environ"), [
    (4, {"PMI_SIZE": "4"}),          # MPI sees the launcher's job
    (1, {}),                         # python train.py: no launcher
    (1, {"SLURM_STEP_NUM_TASKS": "1"}),  # srun -n 1
    (2, {"SLURM_STEP_NUM_TASKS": "4"}),  # not a singleton: MPI's size is the job's
])
def test_agreeing_or_single_launches_pass(world, environ):
  launcher.check_world(world, MPICH, environ)


def test_singletons_are_refused_naming_the_variable_the_mpi_and_the_fix():
  with pytest.raises(RuntimeError) as error:
    launcher.check_world(1, MPICH, {"SLURM_STEP_NUM_TASKS": "2"})
  text = str(error.value)
  assert "the launcher started 2 processes (SLURM_STEP_NUM_TASKS=2), but MPI sees 1" in text
  assert "(MPICH Version:      5.0.2)" in text  # the first line of the library's version
  assert "srun --mpi=pmi2" in text and "srun -n 1" in text
