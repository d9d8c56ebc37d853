"""The typed config: schemas (schemas.py), the one place they are registered with Hydra
(registry.py), what a resume may change and an evaluation must match (settings.py), the
resolvers the YAML files use, rules that span keys (validation.py) and what may be written
(redaction.py). Importing it registers nothing: framework/train.py calls register_configs()."""

from framework.config.validation import validate
from framework.core.config_dir import CONF_DIR  # the shipped config groups

__all__ = ["CONF_DIR", "validate"]
