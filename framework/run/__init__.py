"""One rank of a run: assemble.py builds every object from the config, loop.py is the training
loop, stopping.py how every rank stops at the same step, plots.py the pictures rank 0 draws."""
