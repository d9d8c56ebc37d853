"""The typed config: schemas registered in Hydra's ConfigStore, the resolvers the YAML files use,
and `validate()` for rules that span keys. Importing this package registers them."""

from pathlib import Path

from framework.config.resolvers import register_resolvers
from framework.config.schemas import register_schemas
from framework.config.validation import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the config groups: the repo's conf/

register_schemas()
register_resolvers()

__all__ = ["CONF_DIR", "validate"]
