"""launcher=local: ranks forked on this machine from the process `train` started."""
