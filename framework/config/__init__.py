"""The typed config: schemas (schemas.py), the one place they are registered with Hydra
(registry.py), what a resume may change and an evaluation must match (settings.py), the
resolvers the YAML files use, rules that span keys (validation.py) and what may be written
(redaction.py). Importing it registers nothing: framework/train.py calls register_configs()."""

from pathlib import Path

from framework.config.validation import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the config groups: the repo's conf/

__all__ = ["CONF_DIR", "validate"]
