"""hydra/sweeper=optuna_prune, named to Hydra: Optuna's samplers (hydra-optuna-sweeper's), a
pruner, the study in the sweep dir (framework/app/pruning_sweep.py; the pruners' settings and
bounds: framework/core/pruners.py). Without hydra-optuna-sweeper installed there is no such
option. A shim, as framework_launchers.py is: the framework never imports it."""

# No `from __future__ import annotations`: Hydra executes this module before it is in
# sys.modules, where dataclasses cannot resolve string annotations.

import logging
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper

from framework.core.pruners import pruner_defaults

try:
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
except ImportError:  # hydra-optuna-sweeper is not installed: no pruning sweeper either
    OptunaSweeperConf = None

# Either Optuna sweeper imports optuna once Hydra's logging prints INFO (as it instantiates the
# sampler), and optuna's storage sets up alembic, which logs a line per plugin: not news.
logging.getLogger("alembic").setLevel(logging.WARNING)


class PruningSweeper(Sweeper):
    """hydra/sweeper=optuna_prune: Optuna's samplers, a pruner, the study in the sweep dir."""

    def __init__(self, **settings: Any) -> None:
        from framework.app.pruning_sweep import PruningSweeperImpl  # (optuna: in a sweep only)

        self.sweeper = PruningSweeperImpl(**settings)

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        return self.sweeper.sweep(arguments)


if OptunaSweeperConf is not None:

    @dataclass
    class PruningSweeperConf(OptunaSweeperConf):
        _target_: str = "hydra_plugins.framework_launchers.pruning_sweeper.PruningSweeper"
        # median | asha | hyperband; each one's settings under its name (bounds:
        # framework/core/pruners.py)
        pruner: str = "median"
        median: dict[str, Any] = field(default_factory=lambda: pruner_defaults("median"))
        asha: dict[str, Any] = field(default_factory=lambda: pruner_defaults("asha"))
        hyperband: dict[str, Any] = field(default_factory=lambda: pruner_defaults("hyperband"))

    ConfigStore.instance().store(
        group="hydra/sweeper", name="optuna_prune", node=PruningSweeperConf, provider="framework"
    )
