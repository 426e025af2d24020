"""Config machinery shared by every section: typed dataclass trees, YAML, dotted overrides, one-line errors."""

from gaudi3_scale.config.core import (
    apply_overrides,
    from_dict,
    load_yaml,
    parse_overrides,
    save_yaml,
    to_dict,
)
from gaudi3_scale.config.errors import ConfigError, UserInputError

__all__ = [
    "ConfigError",
    "UserInputError",
    "apply_overrides",
    "from_dict",
    "load_yaml",
    "parse_overrides",
    "save_yaml",
    "to_dict",
]
