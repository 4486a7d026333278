"""The keys of a raw config tree (the nested dict a YAML file holds): dotted paths, renamed keys, and the error that
names a key.

Renamed keys keep working for one release: :data:`RENAMED_KEYS` maps each old dotted key to its new one, and
:func:`migrate_renamed_keys` moves them in the raw tree, with a :class:`ConfigKeyDeprecationWarning` each, before
validation (:func:`aepo_core.overrides.build_config` does it before applying overrides, whose keys are translated
too, so that an override wins in either spelling; :class:`aepo_core.config.ExperimentConfig` does it for trees
validated directly).

This module sits below the schema (``aepo_core/config.py`` imports the migration and :class:`ConfigError` from it)
and knows nothing of it: plain dicts and strings only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A config problem, with the dotted key (or file) it is about in the message."""


class ConfigKeyDeprecationWarning(DeprecationWarning):
    """A config uses a renamed key; the message names its replacement."""


# Shown (once per key) even outside __main__: whoever wrote the YAML file is the one who must act.
warnings.filterwarnings("default", category=ConfigKeyDeprecationWarning)

# Old dotted key → new dotted key. Translated with a warning by build_config; to be removed one release later.
RENAMED_KEYS: dict[str, str] = {
    "rollout.remote_url": "rollout.remote.url",
    "rollout.remote_model": "rollout.remote.model",
    "rollout.remote_reload_url": "rollout.remote.reload_url",
    "data.synthetic_seed": "data.synthetic.seed",
    "data.synthetic_entities": "data.synthetic.entities",
    "data.synthetic_cities": "data.synthetic.cities",
    "data.synthetic_countries": "data.synthetic.countries",
    "data.synthetic_families": "data.synthetic.families",
    "data.synthetic_relations": "data.synthetic.relations",
    "data.synthetic_questions_per_company": "data.synthetic.questions_per_company",
    "data.synthetic_validation_fraction": "data.synthetic.validation_fraction",
    "data.synthetic_test_fraction": "data.synthetic.test_fraction",
    "data.synthetic_templates_per_fact": "data.synthetic.templates_per_fact",
    "data.synthetic_mentions_per_fact": "data.synthetic.mentions_per_fact",
    "data.synthetic_facts_per_document": "data.synthetic.facts_per_document",
    "data.synthetic_near_name_distractors": "data.synthetic.near_name_distractors",
    "data.synthetic_comparison_distractors": "data.synthetic.comparison_distractors",
}


def current_key(key: str, source: str = "") -> str:
    """``key`` itself, or, for a renamed key, its new name (with a :class:`ConfigKeyDeprecationWarning`)."""
    new = RENAMED_KEYS.get(key)
    if new is None:
        return key
    where = f" ({source})" if source else ""
    warnings.warn(f"{key} is deprecated: use {new}{where}", ConfigKeyDeprecationWarning, stacklevel=4)
    return new


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """``tree[a][b] = value`` for ``key`` "a.b", creating missing sections; a non-section on the way is an error."""
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _pop_dotted(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    """Remove ``key`` ("a.b") from the nested tree: (True, its value), or (False, None) when it is not there."""
    *sections, leaf = key.split(".")
    node: Any = tree
    for part in sections:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    return (True, node.pop(leaf)) if leaf in node else (False, None)


def migrate_renamed_keys(tree: dict[str, Any], source: str = "") -> dict[str, Any]:
    """Move every renamed key of a nested tree (a YAML file, a checkpoint's saved config) to its new place, in
    place. Setting a key under both its old and its new name is an error: which one was meant is unknowable."""
    for old in RENAMED_KEYS:
        found, value = _pop_dotted(tree, old)
        if not found:
            continue
        new = current_key(old, source)
        if _pop_dotted(tree, new)[0]:
            raise ConfigError(f"{old} and {new} are both set{f' in {source}' if source else ''}: keep only {new}")
        set_dotted(tree, new, value)
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tree → dotted key → value (the inverse of :func:`set_dotted` over every leaf)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out
