"""Start the ranks of one run (launcher=local|torchrun|slurm|slurm_local), each running
framework/launch/rank_entry.py's enter_rank with the same resolved config and run dir.

The process that launches ranks never imports the training stack (torch._dynamo and the rest):
its ranks get it from the fork server (framework/launch/forkserver.py). Where this process is a
rank itself (one process, a SLURM task) it imports it then.
"""
