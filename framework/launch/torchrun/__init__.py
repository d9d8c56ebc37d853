"""launcher=torchrun (torch's elastic agent run from this process) and a rank of an external
`torchrun` (launchers/torchrun.sh)."""
