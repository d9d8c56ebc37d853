"""Hydra launchers for `train` sweeps, and the user's config folders on Hydra's search path.

Hydra finds plugins only in the hydra_plugins namespace, so this module sits there (installed
with the framework) and only names them: the launchers are Hydra's basic one and
hydra-submitit-launcher's two, each with the sweep summary and, the submitit ones, waiting for
rank 0's result (framework/app/summarized_sweep.py); the sweeper hydra/sweeper=optuna_prune is in
pruning_sweeper.py beside this module; the search
path plugin is framework/app/config_search_path.py. The import contract keeps this module a
shim: the framework never imports it.
"""

# No `from __future__ import annotations`: Hydra executes this module before it is in
# sys.modules, where dataclasses cannot resolve string annotations.

from dataclasses import dataclass

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

from framework.app.config_search_path import UserConfigPath
from framework.app.summarized_sweep import SubmittedSweep, SummarizedSweep

__all__ = ["UserConfigPath"]  # found here by Hydra's plugin scan


class SweepLauncher(SummarizedSweep, BasicLauncher):
    """Hydra's basic launcher (the jobs one after another, from this process)."""


class SubmititSlurmLauncher(SubmittedSweep, SlurmLauncher):
    """launcher=slurm: one SLURM job per sweep job."""


class SubmititLocalLauncher(SubmittedSweep, LocalLauncher):
    """launcher=slurm_local: submitit's local executor, the same job on this machine."""


@dataclass
class SweepLauncherConf:
    _target_: str = "hydra_plugins.framework_launchers.framework_launchers.SweepLauncher"


@dataclass
class SubmititSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.framework_launchers.framework_launchers.SubmititSlurmLauncher"


@dataclass
class SubmititLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.framework_launchers.framework_launchers.SubmititLocalLauncher"


_store = ConfigStore.instance()
for name, node in {
    "framework_basic": SweepLauncherConf,
    "framework_slurm": SubmititSlurmConf,
    "framework_local": SubmititLocalConf,
}.items():
    _store.store(group="hydra/launcher", name=name, node=node, provider="framework")
