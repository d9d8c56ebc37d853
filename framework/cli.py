"""`train`, the console script. It starts the fork server that local ranks are forked from
before it imports anything heavy, so the server's imports (torch, torch._dynamo: most of
start-up) run beside this process's own (Hydra, the launcher) instead of after them. Then it
runs framework.train.main, which `python -m framework.train` runs directly.

It first refuses a torch or torchvision older than the framework supports (core/versions.py).
It makes the working dir importable, last (it shadows nothing installed): a project's package
beside its own conf/ is then found by `_target_` here and in every rank, with no PYTHONPATH.
"""

from __future__ import annotations

import gc
import os
import sys

from framework.core import versions
from framework.core.exits import ConfigError, end
from framework.core.secrets import install_traceback_scrubbing
from framework.launch import forkserver


def main() -> None:
    # Python's cycle collector is off until the config has passed its checks (train.py turns it
    # back on): the imports and compositions make about a million objects, and its passes over
    # them were 0.1 s of the 1.5 s a refused mistake took; a refusal ends the process with it
    # off, which also skips the full collection at exit (docs/benchmarks.md).
    gc.disable()
    install_traceback_scrubbing()  # (Ctrl-C from here on ends without a traceback)
    # Read from package metadata before anything imports torch: a torch below the floor is
    # refused in one line here, not met as an AttributeError inside a rank.
    if unsupported := versions.unsupported_packages():
        end(ConfigError(unsupported))
    # Last, so it shadows nothing installed; before the fork server starts, which copies the path.
    sys.path.append(os.getcwd())
    forkserver.warm_up_if_forking(sys.argv[1:])
    # Imported here, after the fork server has started: importing it first is the cost this
    # module exists to overlap.
    from framework.train import main as train

    train()


if __name__ == "__main__":
    main()
