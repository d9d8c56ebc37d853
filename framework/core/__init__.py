"""The foundation every layer may use: how this process was started (launch_context.py), how a
run ends and with which exit code (exits.py), which callables a config may name (allowlist.py),
process groups and collectives (distributed.py), start-up times (startup_clock.py) and the torch
versions it runs on, with every difference between them (versions.py)."""
