"""Shared plumbing of the benchmarks: environment record, atomic JSON results, tables, thread setup."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from infra.atomic import atomic_file

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` atomically (:func:`infra.atomic.atomic_file`: complete or not at all, mode 0644)."""
    with atomic_file(path, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=False, default=_json_default)
        fh.write("\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table when rich is importable, else aligned plain text."""
    cells = [[_fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(str(h).ljust(w) for h, w in zip(columns, widths, strict=True)))
        for row in cells:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(str(col))
    for row in cells:
        table.add_row(*row)
    Console(width=max(160, shutil.get_terminal_size().columns)).print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def set_threads(n: int) -> None:
    """Fix torch's intra-op threads (and inter-op, when still allowed) for the whole run."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # already set (parallel work ran): intra-op is what matters here
        pass


def autocast_of(name: str) -> torch.dtype | None:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)


def environment(threads: int, *, cpu: bool = True) -> dict[str, Any]:
    """Versions, thread count, CPU and load average at start; ``cpu=False`` leaves out the CPU name."""
    import transformers

    env: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
    }
    if cpu:
        env["cpu"] = platform.processor() or platform.machine()
    env["load_avg_start"] = list(os.getloadavg())
    return env
