"""The `train` command around Hydra, in the process a user starts: the callback that refuses a
bad config before any dir exists, Hydra's own errors turned into our exit codes, and a sweep's
summary. framework/train.py is the Hydra app itself; framework/launch/ starts the ranks."""
