"""One rank of a run: main.py takes it from the process group to the end; build.py builds every
object from the config; loop.py is the training loop; state.py the run state a checkpoint saves;
model_selection.py best-K checkpoints, early stopping and the final test with the best;
evaluation.py the exact evaluation, eval_mode.py mode=eval; nonfinite.py what a non-finite loss
or gradient does; stopping.py how every rank stops at the same step; finish.py the summary and
what the end writes; plots.py the pictures rank 0 draws; estimate.py mode=estimate's memory
ledger, without a process group."""
