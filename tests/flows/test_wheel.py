"""``pip install .`` gives a package that works from any directory: the wheel built from this checkout, installed into
a fresh virtualenv, runs ``aepo --help``, resolves the shipped datasets from its own copy, and trains the tiny config
from a directory that is not the checkout.

The fresh virtualenv borrows the suite's dependencies (a path to ``.venv``'s site-packages, which a plain path entry
does not scan for ``.pth`` files: the editable install of this checkout stays out) and gets the wheel itself with
``pip install --no-deps``, so what is tested is the wheel's contents: its packages, its package data and its entry
point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: setuptools builds in the source tree (build/), never in the checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "site", "build", "bench",
                                                                "*.egg-info", "__pycache__", ".*_cache"))
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                  str(root / "dist"), str(source)], cwd=root)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (root / "dist").glob("aepo-*.whl")
    venv = root / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root).returncode == 0
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=root).stdout.strip())
    (site / "suite-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                      "--no-deps", "--no-index", str(wheel)], cwd=root)
    assert installed.returncode == 0, installed.stderr[-2000:]
    return venv


def test_the_wheel_s_aepo_runs_from_anywhere_with_its_own_code_and_data(wheel_env: Path, tmp_path: Path) -> None:
    python, aepo = wheel_env / "bin" / "python", wheel_env / "bin" / "aepo"
    where = _run([str(python), "-c", "import infra, flows; from infra.data.loaders import default_data_root, "
                  "shipped_names; print(infra.__file__); print(default_data_root()); print(len(shipped_names()))"],
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr[-2000:]
    package, data_root, names = where.stdout.split()
    assert str(wheel_env) in package and str(REPO) not in package  # the wheel's code, not this checkout's
    assert data_root.startswith(str(wheel_env)) and int(names) == 13  # its own copy of the data
    shown = _run([str(aepo), "--help"], cwd=tmp_path)
    assert shown.returncode == 0 and "train" in shown.stdout and "sweep" in shown.stdout


@pytest.mark.slow
def test_the_wheel_trains_the_tiny_config_outside_the_checkout(wheel_env: Path, tmp_path: Path) -> None:
    trained = _run([str(wheel_env / "bin" / "aepo"), "train", "-c", str(REPO / "configs" / "tiny.yaml"),
                    "--set", "train.steps=1", "--set", "eval.max_questions=2", "--runs-dir", str(tmp_path / "runs")],
                   cwd=tmp_path, timeout=900)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
    assert (tmp_path / "runs" / "mlflow.db").is_file()
    assert not (tmp_path / "mlflow.db").exists() and not (REPO / "runs" / "tiny").exists()
