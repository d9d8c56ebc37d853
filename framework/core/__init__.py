"""The foundation every layer may use: how this process was started (launch_context.py), how a
run ends and with which exit code (exits.py), which callables a config may name (allowlist.py),
process groups and collectives (distributed.py) and start-up times (startup_clock.py)."""
