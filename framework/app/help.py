"""`train --help` and `train --cfg job`, answered from the composition the checks made.

Hydra's own help lists its config groups through the config loader, which copies its whole
config store for every group it is asked about (about 0.2 s a group here: 190 groups, over 20 s
on 2 busy cores), and it computes the lists of Hydra's own groups too, which the framework's
template never shows. This renders the same template (conf/config.yaml's hydra.help) from one
composition, the groups asked of the config repository directly. Hydra's --cfg job composes
the config once more after its start-up; this prints the one composed.
"""

from __future__ import annotations

import argparse
import string

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from omegaconf import DictConfig, OmegaConf, open_dict

from framework.config.resolvers import group_listing
from framework.core.exits import ConfigError

CONFIG_GROUPS = "config_groups"  # the resolver conf/config.yaml's template lists groups with


def help_text(cfg: DictConfig, loader: ConfigLoaderImpl, resolve: bool) -> str:
    """What `train --help` prints for this composition."""
    template = string.Template(_template(cfg))
    return template.safe_substitute(
        FLAGS_HELP=Hydra.format_args_help(get_args_parser()),
        APP_CONFIG_GROUPS=group_listing(loader.get_sources()),
        HYDRA_CONFIG_GROUPS="",
        CONFIG=OmegaConf.to_yaml(_without_hydra(cfg), resolve=resolve),
    )


def prints_the_job_config(args: argparse.Namespace) -> bool:
    """`--cfg job` as it prints the composition: the config without its hydra node, unresolved,
    as Hydra's show_cfg writes it (a test holds the two to the same bytes). --resolve and
    --package read the runtime Hydra sets, and --hydra-help is answered first: Hydra's."""
    return args.cfg == "job" and not (args.resolve or args.package is not None or args.hydra_help)


def job_config_text(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(_without_hydra(cfg))


def _template(cfg: DictConfig) -> str:
    """hydra.help.template with its other interpolations (the header, the footer) resolved; the
    groups (the `config_groups` resolver, which asks a running Hydra) become Hydra's own
    $APP_CONFIG_GROUPS, filled in above."""
    raw = OmegaConf.to_container(cfg.hydra.help, resolve=False)["template"]
    cfg.hydra.help.template = str(raw).replace(f"${{{CONFIG_GROUPS}:}}", "$APP_CONFIG_GROUPS")
    return str(cfg.hydra.help.template)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    clean = cfg.copy()
    with open_dict(clean):
        del clean["hydra"]
    return clean


def check_shown_package(cfg: DictConfig, args: argparse.Namespace) -> None:
    """--cfg's --package names a key of what --cfg shows: Hydra's show_cfg selects it and
    prints "not found" with exit 1 where the selection is None (a missing or null key). A
    selection that cannot resolve here (an interpolation of Hydra's runtime) is left to
    Hydra."""
    package = args.package
    if args.cfg is None or args.hydra_help or package in (None, "_global_"):
        return
    shown = [key for key in cfg if (key == "hydra") == (args.cfg == "hydra")]
    view = cfg if args.cfg == "all" else OmegaConf.masked_copy(cfg, shown)
    if args.cfg == "hydra" and package.startswith(("hydra.help", "hydra.hydra_help")):
        selected = None  # what Hydra's get_sanitized_hydra_cfg removes
    else:
        try:
            selected = OmegaConf.select(view, package)
        except Exception:  # noqa: BLE001 (Hydra resolves it with its runtime set, or reports it)
            return
    if selected is None:
        shows = f"`train --cfg {args.cfg}` shows the whole config"
        raise ConfigError(f"--package {package}: not a key, or null: nothing to show ({shows})")
