"""Hydra-configured experiments that run as one DistributedDataParallel job."""

import time

# The package's first import, before anything heavy: core/startup_clock.py counts from here.
IMPORTED_AT = time.time()
