"""Reading experiment configs from YAML files (the core parses text; files are infra's business)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import config_from_yaml
from infra.encoding import line_at, not_utf8


def load_config(path: str | Path | None, overrides: Mapping[str, Any] | Iterable[str] = ()) -> ExperimentConfig:
    """Load ``path`` (or the defaults when None) and apply dotted overrides; errors name the file and key."""
    if path is None:
        return config_from_yaml("{}", overrides, source="defaults")
    p = Path(path)
    return config_from_yaml(read_config_text(p, "config file"), overrides, source=str(p))


def read_config_text(path: Path, what: str) -> str:
    """The text of a YAML file the user wrote (``what`` names it in errors: "config file", "sweep file"); a missing,
    unreadable or non-UTF-8 file is a :class:`ConfigError` naming the file (and the line and byte)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: line {line_at(data, exc.start)}: {not_utf8(exc)}") from None


def save_config(cfg: ExperimentConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML atomically (temp file, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(cfg.to_yaml(), encoding="utf-8")
    tmp.replace(p)
    return p
