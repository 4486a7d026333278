"""A pydantic model as YAML with every field's description above it as ``#`` comments: what
``aepo config show --describe`` prints (:meth:`aepo_core.config.ExperimentConfig.to_yaml`); it loads back to the same
values.
"""

from __future__ import annotations

import textwrap

import yaml
from pydantic import BaseModel


def described_lines(model: BaseModel, depth: int, width: int = 100) -> list[str]:
    """YAML lines of ``model``'s fields, each preceded by its description as ``#`` comments (nested sections
    indented); values as ``model_dump(mode="json")`` writes them."""
    pad = "  " * depth
    data = model.model_dump(mode="json")
    lines: list[str] = []
    for name, info in type(model).model_fields.items():
        if info.description:
            lines += [f"{pad}# {line}" for line in textwrap.wrap(info.description, max(40, width - len(pad) - 2))]
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines += described_lines(value, depth + 1, width)
        else:
            dumped = yaml.safe_dump({name: data[name]}, sort_keys=False, width=10**6)
            lines += [pad + line for line in dumped.rstrip("\n").splitlines()]
    return lines
