"""launcher=slurm|slurm_local: the submitting side (the partition check, the submitit sweep
that waits for rank 0's result) and the task inside the job that is one rank."""
