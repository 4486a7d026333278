"""aepo_core stays pure: it imports none of the orchestration, tracking, storage or serving packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"prefect", "mlflow", "vllm", "deepspeed", "s3fs", "fsspec", "pyarrow", "boto3", "requests", "httpx",
             "infra", "tasks", "flows", "transformers"}
LAYERS = {"infra": {"tasks", "flows"}, "tasks": {"flows"}}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_aepo_core_imports_nothing_forbidden():
    files = sorted((ROOT / "aepo_core").rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(imported_roots(f) & FORBIDDEN) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_imports_point_down_only():
    for layer, above in LAYERS.items():
        for f in sorted((ROOT / layer).rglob("*.py")):
            assert not imported_roots(f) & above, f"{f.relative_to(ROOT)} imports a layer above it"


def test_importing_the_core_loads_no_forbidden_module():
    modules = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in sorted((ROOT / "aepo_core").rglob("*.py"))
        if p.name != "__init__.py"
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
