"""What the tests share: the mpirun launcher with a hard timeout, and the scripts the job tests
run in fresh processes (fault injection, a killed run, a save that never ends, workers)."""
