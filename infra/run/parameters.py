"""A flow's config parameter as Prefect hands it over (a deployment's run passes JSON: a config object, a plain
tree or a YAML path), resolved once at the flow's entry; the flows below take an :class:`ExperimentConfig`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aepo_core.config import ExperimentConfig
from aepo_core.overrides import build_config
from infra.config_files import load_config


def resolve_config(config: ExperimentConfig | Mapping[str, object] | str | None, overrides: Sequence[str] | None
                   ) -> ExperimentConfig:
    """A flow's ``config`` parameter plus dotted ``overrides`` (the same path as the CLI's ``--set``); the defaults
    when none is given."""
    if isinstance(config, str):
        config = load_config(config)
    tree = config.to_dict() if isinstance(config, ExperimentConfig) else dict(config or {})
    return build_config(tree, list(overrides or []), source="flow parameters")


def given_config(config: ExperimentConfig | Mapping[str, object] | str | None) -> ExperimentConfig | None:
    """A flow's ``config`` parameter (object, plain tree or YAML path) as a config; None when none is given (the
    checkpoint's own config is then used)."""
    if isinstance(config, str):
        return load_config(config)
    if isinstance(config, Mapping):
        return build_config(config, (), source="evaluate parameters")
    return config
