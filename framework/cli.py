"""`train`, the console script. It refuses a torch or torchvision older than the framework
supports (core/versions.py), starts the fork server local ranks are forked from before anything
heavy is imported (launch/forkserver.py), then runs framework.train.main (which `python -m
framework.train` runs directly). The working dir is importable, last (it shadows nothing
installed): a project's package beside its conf/ is found here and in every rank."""

from __future__ import annotations

import gc
import os
import sys

from framework.core import versions
from framework.core.exits import ConfigError, end
from framework.core.secrets import install_traceback_scrubbing
from framework.launch import forkserver


def main() -> None:
    # The cycle collector is off until the config has passed its checks (train.py turns it back
    # on): its passes over the imports' and compositions' million objects were 0.1 s of a 1.5 s
    # refusal, which then also skips the full collection at exit (docs/benchmarks.md).
    gc.disable()
    install_traceback_scrubbing()  # (Ctrl-C from here on ends without a traceback)
    # From package metadata, before torch loads: too old a torch is one line, not a rank error.
    if unsupported := versions.unsupported_packages():
        end(ConfigError(unsupported))
    # Last, so it shadows nothing installed; before the fork server starts, which copies the path.
    sys.path.append(os.getcwd())
    forkserver.warm_up_if_forking(sys.argv[1:])
    # Imported after the fork server has started: overlapping the two is this module's point.
    from framework.train import main as train

    train()


if __name__ == "__main__":
    main()
