"""The documentation site: its generated reference covers what the code has (every config key, CLI command, Parquet
column, loss and advantage estimator), and ``mkdocs build --strict`` passes, and fails on a broken link (so the
check has teeth)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aepo_core.advantages import ADVANTAGE_ESTIMATORS
from aepo_core.config import ExperimentConfig
from aepo_core.losses import POLICY_LOSSES
from flows.cli import app
from infra.run.evaluation import QUESTION_SCHEMA
from infra.run.study import PROFILE_SCHEMA
from infra.store import SCHEMAS

REPO = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    """Dotted keys of a dumped config (independent of the generator's walk over the model classes)."""
    keys = []
    for name, value in tree.items():
        nested = isinstance(value, dict) and value and name not in ("extra_body",)
        keys += _leaf_keys(value, f"{prefix}{name}.") if nested else [f"{prefix}{name}"]
    return keys


def test_the_config_reference_has_every_key_with_its_description() -> None:
    page = _hook().config_page()
    keys = _leaf_keys(ExperimentConfig().model_dump(mode="json"))
    assert len(keys) > 150
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert missing == []
    assert "| `optim.share_prefix` | one of 'auto', 'off', 'common', 'tree' | `\"auto\"` |" in page  # declared default


def test_the_cli_reference_has_every_command() -> None:
    page = _hook().cli_page()
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    names += [f"{g.name} {c.name or c.callback.__name__}" for g in app.registered_groups
              for c in g.typer_instance.registered_commands]
    assert {"train", "eval", "sweep", "replay", "config show"} <= set(names)
    missing = [n for n in names if f"## `aepo {n}`" not in page]
    assert missing == []
    assert "--runs-dir" in page.split("## `aepo train`")[1]  # the options, not only the name


def test_the_tables_reference_has_every_column() -> None:
    page = _hook().tables_page()
    for schema in [*SCHEMAS.values(), QUESTION_SCHEMA, PROFILE_SCHEMA]:
        missing = [f.name for f in schema if f"| `{f.name}` | `{f.type}` |" not in page]
        assert missing == []


def test_the_algorithms_reference_has_every_registered_function_and_its_formula() -> None:
    page = _hook().algorithms_page()
    for name in [*POLICY_LOSSES, *ADVANTAGE_ESTIMATORS]:
        assert f"### `{name}`" in page
    assert "−min(r·Â, clip(r, 1−ε_l, 1+ε_h)·Â)" in page  # ppo_clip's docstring


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_the_site_builds_strictly_and_a_broken_link_fails_it(tmp_path: Path) -> None:
    built = _build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    for page in ("index.html", "reference/config/index.html", "reference/cli/index.html",
                 "reference/tables/index.html", "reference/algorithms/index.html", "results/index.html",
                 "how-to/gpu-recipes/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the same site with one broken link: --strict must refuse it
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(REPO / "docs", copy / "docs")
    (copy / "configs" / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "recipes" / "README.md", copy / "configs" / "recipes" / "README.md")
    (copy / "bench").mkdir()
    shutil.copy(REPO / "bench" / "README.md", copy / "bench" / "README.md")
    shutil.copytree(REPO / "bench" / "results", copy / "bench" / "results",
                    ignore=shutil.ignore_patterns("store", "*.json", "*.db"))
    (copy / "docs" / "quickstart.md").write_text((REPO / "docs" / "quickstart.md").read_text()
                                                 + "\n[gone](how-to/no-such-page.md)\n")
    broken = _build(copy, tmp_path / "site2")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr
