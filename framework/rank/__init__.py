"""One rank of a run: assemble.py builds every object from the config; loop.py is the training
loop; state.py the run state a checkpoint saves; selection.py best-K checkpoints, early stopping
and the final test with the best; evaluation.py the exact evaluation and mode=eval; stopping.py
how every rank stops at the same step; plots.py the pictures rank 0 draws."""
