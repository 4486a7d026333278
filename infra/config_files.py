"""Reading experiment configs from YAML files (the core parses text; files are infra's business)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aepo_core.config import ConfigError, ExperimentConfig, config_from_yaml


def load_config(path: str | Path | None, overrides: Mapping[str, Any] | Iterable[str] = ()) -> ExperimentConfig:
    """Load ``path`` (or the defaults when None) and apply dotted overrides; errors name the file and key."""
    if path is None:
        return config_from_yaml("{}", overrides, source="defaults")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from None
    return config_from_yaml(text, overrides, source=str(p))


def save_config(cfg: ExperimentConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML atomically (temp file, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(cfg.to_yaml(), encoding="utf-8")
    tmp.replace(p)
    return p
