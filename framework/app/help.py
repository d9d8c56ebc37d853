"""`train --help`, answered from one composition.

Hydra's own help lists its config groups through the config loader, which copies its whole
config store for every group it is asked about (about 0.2 s a group here: 190 groups, over 20 s
on 2 busy cores), and it computes the lists of Hydra's own groups too, which the framework's
template never shows. This renders the same template (conf/config.yaml's hydra.help) from one
composition, the groups asked of the config repository directly.
"""

from __future__ import annotations

import string

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.utils import JobRuntime
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from framework.app.hydra_node_check import composition_refusal, config_name_of, search_path
from framework.config.redaction import remember_secrets
from framework.config.registry import register_configs
from framework.config.resolvers import group_listing
from framework.config.validation import check_keys
from framework.core.allowlist import parsed_arguments

APP_NAME = "train"  # what Hydra names the job of framework/train.py
CONFIG_GROUPS = "config_groups"  # the resolver conf/config.yaml's template lists groups with


def help_text(argv: list[str]) -> str | None:
    """What `train <argv>` prints for --help; None when argv does not ask for it."""
    args = parsed_arguments(argv)
    if args is None or not args.help:
        return None
    register_configs()
    loader = ConfigLoaderImpl(config_search_path=search_path(args))
    JobRuntime.instance().set("name", APP_NAME)  # hydra.job.name, as Hydra sets it
    try:
        cfg = loader.load_configuration(
            config_name_of(args), list(args.overrides), run_mode=RunMode.RUN
        )
    except Exception as error:  # what Hydra's help would have met: its message, one line
        refusal = composition_refusal(error, loader, list(args.overrides), config_name_of(args))
        if refusal is None:
            raise
        raise refusal from None
    remember_secrets(cfg)  # the console scrubs them from the text printed
    check_keys(cfg)  # the config shown is the one meant: no misspelt key, no value of a wrong type
    template = string.Template(_template(cfg))
    return template.safe_substitute(
        FLAGS_HELP=Hydra.format_args_help(get_args_parser()),
        APP_CONFIG_GROUPS=group_listing(loader.get_sources()),
        HYDRA_CONFIG_GROUPS="",
        CONFIG=OmegaConf.to_yaml(_without_hydra(cfg), resolve=args.resolve),
    )


def shown_config(argv: list[str], composed: DictConfig | None) -> str | None:
    """What `train --cfg job` prints, from the composition the checks made and checked: Hydra's
    own --cfg composes it once more, after its start-up (0.4-0.6 s). None where Hydra answers:
    --cfg hydra or all, --resolve and --package, which read the runtime Hydra sets, and
    --hydra-help, which Hydra answers first. It writes what Hydra's show_cfg writes: the
    config without its hydra node, unresolved (a test holds the two to the same bytes)."""
    args = parsed_arguments(argv)
    if args is None or composed is None or args.cfg != "job":
        return None
    if args.resolve or args.package is not None or args.hydra_help:
        return None
    return OmegaConf.to_yaml(_without_hydra(composed))


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
