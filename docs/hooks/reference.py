"""The docs' generated pages, made from the code at every build (an MkDocs hook: ``mkdocs.yml`` ``hooks:``), so they
cannot go stale:

- ``reference/config.md``: every config field, dotted, with its type, default and description (the pydantic tree);
- ``reference/cli.md``: every ``aepo`` command's help, as its parser prints it (the Typer app);
- ``reference/tables.md``: every Parquet table's columns, types and descriptions (the Arrow schemas);
- ``reference/algorithms.md``: the registered policy losses and advantage estimators with their docstrings;
- ``results.md``: ``bench/README.md`` (the measured results) with the figures it shows;
- ``how-to/gpu-recipes.md``: ``configs/recipes/README.md`` (the GPU recipes, beside their sweep files).

``tests/docs/test_docs.py`` checks the pages cover what the code has and builds the site with ``--strict``.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pyarrow as pa
import typer
from pydantic import BaseModel
from typer.core import TyperGroup

REPO = Path(__file__).resolve().parents[2]
RESULTS_SOURCE = REPO / "bench" / "README.md"
RECIPES_SOURCE = REPO / "configs" / "recipes" / "README.md"


# ----------------------------------------------------------------------------------------------------- config


def config_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted key, annotation, default, description) of every leaf field of ``model``, sections recursed."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from config_fields(annotation, f"{key}.")
        else:
            yield key, annotation, info.get_default(call_default_factory=True), info.description or ""


def _type_name(annotation: Any) -> str:
    """``one of 'a', 'b'`` for a Literal, ``int or null`` for an optional, else the type's name."""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if isinstance(annotation, types.UnionType) or get_origin(annotation) is Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(annotation))
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def config_page() -> str:
    from aepo_core.config import ExperimentConfig

    lines = ["# Configuration reference", "",
             "Every key of the experiment config (`aepo_core/config.py` and the sections it imports), as a dotted",
             "path for `--set key=value` and sweep files, with its type, default and description. Generated from",
             "the pydantic tree at every docs build. `aepo config show --describe` prints the same as YAML.", ""]
    section = None
    for key, annotation, default, description in config_fields(ExperimentConfig):
        top = key.split(".")[0] if "." in key else "(top level)"
        if top != section:
            section = top
            lines += ["", f"## `{top}`" if top != "(top level)" else "## Top level", "",
                      "| key | type | default | description |", "|---|---|---|---|"]
        shown = json.dumps(default.model_dump(mode="json") if isinstance(default, BaseModel) else default,
                           default=str)
        lines.append(f"| `{key}` | {_cell(_type_name(annotation))} | `{_cell(shown)}` | {_cell(description)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -------------------------------------------------------------------------------------------------------- CLI


def cli_commands() -> Iterator[tuple[str, Any]]:
    """(full name, command) of every ``aepo`` command and subcommand, groups included (Typer's own click)."""
    from flows.cli import app

    def walk(cmd: Any, name: str) -> Iterator[tuple[str, Any]]:
        yield name, cmd
        if isinstance(cmd, TyperGroup):
            for sub_name in sorted(cmd.commands):
                yield from walk(cmd.commands[sub_name], f"{name} {sub_name}")

    yield from walk(typer.main.get_command(app), "aepo")


def cli_page() -> str:
    lines = ["# Command-line reference", "",
             "Every `aepo` command's help, as `aepo <command> --help` prints it (generated from the Typer app at",
             "every docs build). A user mistake (a bad config key or value, an unknown run, experiment, step,",
             "question or leaf, a missing file) exits with status 2 and one line, before anything is created; a run",
             "that fails or a service that does not answer exits with status 1.", ""]
    for name, cmd in cli_commands():
        ctx = typer.Context(cmd, info_name=name, max_content_width=110, terminal_width=110)
        lines += [f"## `{name}`", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- tables


def parquet_tables() -> dict[str, tuple[str, pa.Schema]]:
    """Table name → (where it is written, its Arrow schema), for every Parquet table the runs dir holds."""
    from infra.run.evaluation import QUESTION_SCHEMA
    from infra.run.study import PROFILE_SCHEMA
    from infra.store import SCHEMAS

    return {"trajectories": ("runs/trajectories/ (one row per leaf)", SCHEMAS["trajectories"]),
            "nodes": ("runs/nodes/ (one row per node of a rollout tree)", SCHEMAS["nodes"]),
            "eval": ("runs/eval/<run name>/<dataset>.parquet (one row per question)", QUESTION_SCHEMA),
            "study profiles": ("the rollout study's artifact (one row per question and arm)", PROFILE_SCHEMA)}


def column_description(field: pa.Field) -> str:
    meta = field.metadata or {}
    text = meta.get(b"description") or meta.get(b"doc") or b""
    return text.decode()


def tables_page() -> str:
    lines = ["# Parquet tables", "",
             "The columns of every table a run writes, from the Arrow schemas in the code (`infra/store.py`,",
             "`infra/run/evaluation.py`, `infra/run/study.py`). The descriptions also travel inside each file",
             "(field metadata `description`), so pandas, polars, pyarrow and DuckDB users see them too.", ""]
    for name, (where, schema) in parquet_tables().items():
        lines += [f"## `{name}`", "", f"Written to {where}.", "",
                  "| column | type | nullable | description |", "|---|---|---|---|"]
        for f in schema:
            described = column_description(f) or "*(not described yet)*"
            lines.append(f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} | {_cell(described)} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- algorithms


def algorithms_page() -> str:
    from aepo_core.advantages import ADVANTAGE_ESTIMATORS
    from aepo_core.losses import POLICY_LOSSES

    lines = ["# Losses and advantage estimators", "",
             "The registries of `aepo_core/losses.py` (`algorithm.loss`) and `aepo_core/advantages.py`",
             "(`algorithm.advantage`), each entry with its docstring, which states the formula. Adding one:",
             "[Extending](../how-to/extending.md).", ""]
    for title, registry in (("Policy losses", POLICY_LOSSES), ("Advantage estimators", ADVANTAGE_ESTIMATORS)):
        lines += [f"## {title}", ""]
        for name, fn in registry.items():
            doc = inspect.getdoc(fn) or "(no docstring)"
            lines += [f"### `{name}`", "", f"`{fn.__module__}.{fn.__name__}`", "", "```text",
                      textwrap.dedent(doc), "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- results


def results_page() -> tuple[str, list[str]]:
    """``bench/README.md`` as the Results page, and the repository paths of the figures it shows (relative to
    bench/)."""
    text = RESULTS_SOURCE.read_text(encoding="utf-8")
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    note = ("> Measured results, as kept in the repository's `bench/README.md` (each section names its command, "
            "machine and commit; the JSON behind every table is under `bench/results/`).\n\n")
    return note + text, figures


PAGES = {"reference/config.md": config_page, "reference/cli.md": cli_page, "reference/tables.md": tables_page,
         "reference/algorithms.md": algorithms_page}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages and the Results page's figures."""
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    text, figures = results_page()
    files.append(File.generated(config, "results.md", content=text))
    files.append(File.generated(config, "how-to/gpu-recipes.md", content=RECIPES_SOURCE.read_text(encoding="utf-8")))
    for figure in figures:
        files.append(File.generated(config, figure, abs_src_path=str(RESULTS_SOURCE.parent / figure)))
    return files
