"""Reading one field of a config node, whatever it is (DictConfig, dict or attribute object)."""

from __future__ import annotations

from typing import Any

from adaloss.errors import ConfigError

#: Sentinel for "no default": the field is required.
MISSING = object()


def config_field(cfg: Any, key: str, default: Any = MISSING, group: str = "config") -> Any:
    """``cfg[key]``; ``default`` when absent or null. A required field (no default) that is absent raises
    ``ConfigError`` naming ``<group>.<key>``. Lets builders take Hydra nodes and plain dicts (tests, the
    scripts) alike."""
    if hasattr(cfg, "get") and callable(cfg.get):
        value = cfg.get(key, MISSING)
    else:
        value = getattr(cfg, key, MISSING)
    if value is MISSING or value is None:
        if default is MISSING:
            raise ConfigError(f"{group} config is missing the field '{key}'")
        return default
    return value
