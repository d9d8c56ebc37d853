"""The typed config: schemas (schemas.py), the one place they are registered with Hydra
(registry.py), what each key is (keys.py) and the facts between keys (validation.py), what a
resume may change and an evaluation must match (resume_rules.py), the resolvers the YAML files
use and what may be written (redaction.py). Importing it registers nothing:
framework/app/composition.py calls register_configs()."""

from framework.core.config_dir import CONF_DIR  # the shipped config groups

__all__ = ["CONF_DIR"]
