"""`train`, the console script. It starts the fork server that local ranks are forked from
before it imports anything heavy, so the server's imports (torch, torch._dynamo: most of
start-up) run beside this process's own (Hydra, the launcher) instead of after them. Then it
runs framework.train.main, which `python -m framework.train` runs directly.
"""

from __future__ import annotations

import sys

from framework.launch import forkserver


def main() -> None:
    forkserver.warm_up_if_forking(sys.argv[1:])
    # Imported here, after the fork server has started: importing it first is the cost this
    # module exists to overlap.
    from framework.train import main as train

    train()


if __name__ == "__main__":
    main()
