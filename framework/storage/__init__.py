"""What a run keeps on disk: the run dir's files and lifecycle (run_dir.py) and checkpoints
(checkpoint.py). Only rank 0 writes."""
