"""Shared plumbing of the benchmarks: environment record, atomic JSON results, tables, thread setup."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
from collections.abc import Mapping, Sequence
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


def environment(threads: int, *, numerics: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Where and on what a benchmark ran: the commit, the machine (CPU model, torch's kernel capability, native bf16
    and the start-up probe's bf16 speed-up, cores, any ISA restriction of the kernels), versions, threads, the
    load average at start, and ``numerics`` (the dtypes the benchmark resolved, e.g. ``Numerics.params()``)."""
    import transformers

    from infra.numerics import device_facts
    from infra.tracking.client import git_sha

    facts = device_facts("cpu")
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_sha(Path(__file__).parent),
        "cpu": facts.name,
        "capability": facts.capability,
        "native_bf16": facts.native_bf16,
        "bf16_speedup": facts.bf16_speedup,
        "fast_bf16": facts.fast_bf16,
        "isa_restrictions": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "numerics": dict(numerics or {}),
        "load_avg_start": list(os.getloadavg()),
    }


ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Environment variables that hold torch's kernels below the CPU's ISA (how an AMX machine imitates an AVX2 one)."""


def machine_label(env: Mapping[str, Any]) -> str:
    """``<cpu> (<capability>[, kernels held to …])`` for a table's title: every figure names where it came from."""
    held = env.get("isa_restrictions") or {}
    restriction = f", kernels held to {'/'.join(sorted(set(held.values())))}" if held else ""
    return f"{env.get('cpu', '?')} ({env.get('capability', '?')}{restriction})"


def default_compute(model_name: str) -> str:
    """A benchmark's autocast dtype when ``--compute`` is not given: float32 for tiny-random (exact, and faster
    than autocast for 3M parameters), else what ``auto`` resolves to on this CPU (bf16 only where it is fast)."""
    from infra.models import TINY_RANDOM
    from infra.numerics import auto_dtype, device_facts

    return "float32" if model_name == TINY_RANDOM else auto_dtype(device_facts("cpu"))
