"""What a config group picks: models, data, tasks, optimizers and schedulers, precision, DDP
communication hooks, loggers, and the weights' moving average. Each is built by `_target_` from
its group's option; the options' typed schemas are in framework/config/schemas.py."""
