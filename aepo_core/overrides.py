"""A config from a raw tree or YAML text, with dotted ``key=value`` overrides on top (CLI ``--set`` and Prefect
parameters use the same path), validated into an :class:`~aepo_core.config.ExperimentConfig`.

Renamed keys (:data:`~aepo_core.config_keys.RENAMED_KEYS`) are translated first, in the tree and in the overrides,
with a :class:`~aepo_core.config_keys.ConfigKeyDeprecationWarning` each. Unknown keys and wrong types fail with a
:class:`~aepo_core.config_keys.ConfigError` that names the dotted key.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError, current_key, migrate_renamed_keys, set_dotted


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` → ("a.b", parsed value); the value is read as a YAML scalar/flow collection."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
    return key, value


def apply_overrides(tree: dict[str, Any], overrides: Mapping[str, Any] | Iterable[str],
                    source: str = "") -> dict[str, Any]:
    """Set dotted keys in a nested dict, in order (renamed keys under their new name); unknown keys are caught
    later by validation, naming the key."""
    pairs = overrides.items() if isinstance(overrides, Mapping) else (parse_override(o) for o in overrides)
    for key, value in pairs:
        try:
            set_dotted(tree, current_key(key, source), value)
        except ConfigError as exc:
            raise ConfigError(f"override {exc}") from None
    return tree


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        yield f"{prefix}{name}"
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from _dotted_keys(info.annotation, f"{prefix}{name}.")


@functools.cache
def known_keys() -> tuple[str, ...]:
    """Every dotted key of the config tree, its sections included."""
    return tuple(_dotted_keys(ExperimentConfig))


def did_you_mean(word: str, known: Iterable[str], cutoff: float = 0.75) -> str:
    """`` (did you mean 'rollout.gamma'?)``: the closest of ``known`` to a mistyped ``word``, when one is close (a
    config key, a CLI choice, an arm); "" otherwise."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=cutoff)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _unknown_key(loc: str) -> str:
    """``unknown key 'rollout.gama' (did you mean 'rollout.gamma'?)``: the closest known key, when one is close."""
    return f"unknown key '{loc}'" + did_you_mean(loc, known_keys())


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key(loc))
        elif err["type"] == "value_error":  # a cross-field check: its message names the keys, the input is noise
            message = str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
            lines.append(f"'{loc}': {message}" if loc else message)
        else:
            lines.append(f"'{loc or '<root>'}': {err['msg']} (got {err.get('input')!r})")
    return f"invalid config{source}: " + "; ".join(lines)


def build_config(tree: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | Iterable[str] = (),
                 source: str = "") -> ExperimentConfig:
    """Validate ``tree`` with the dotted ``overrides`` applied on top. Renamed keys
    (:data:`~aepo_core.config_keys.RENAMED_KEYS`), in either, are translated first, with a
    :class:`~aepo_core.config_keys.ConfigKeyDeprecationWarning` each."""
    data = json.loads(json.dumps(dict(tree or {})))  # deep copy of plain data
    migrate_renamed_keys(data, source)
    apply_overrides(data, overrides, source)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, f" ({source})" if source else "")) from None


def config_from_yaml(
    text: str, overrides: Mapping[str, Any] | Iterable[str] = (), source: str = ""
) -> ExperimentConfig:
    """Parse YAML text (no file I/O here: infra reads files) and apply overrides."""
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse YAML{f' in {source}' if source else ''}: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config{f' {source}' if source else ''} must be a mapping at the top level")
    return build_config(tree, overrides, source)
