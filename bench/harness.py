"""Shared plumbing of the benchmarks: environment record, the one writer of results (atomic JSON that names the commit
and the CPU it was measured on), tables, thread setup."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from infra.atomic import atomic_file

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"


def write_result(path: Path, data: Mapping[str, Any]) -> None:
    """Write a benchmark's result to ``path`` as JSON, atomically (:func:`infra.atomic.atomic_file`: complete or not
    at all, mode 0644), with ``commit`` and ``cpu`` (:func:`cpu_label`) first, unless ``data`` already names them:
    every figure under ``bench/results/`` says which code measured it on which CPU. The commit is the one the bench
    started on (its :func:`environment`'s; a bench of hours imports its code at start, and a commit made meanwhile
    did not measure anything), else the tree's now; ``commit_at_write`` follows it when the tree moved since."""
    env = data.get("environment")
    started = env.get("commit") if isinstance(env, Mapping) else None
    now = tree_commit()
    record = {"commit": started or now, "cpu": cpu_label(), **({"commit_at_write": now} if started and started != now
                                                                else {}), **data}
    with atomic_file(path, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=False, default=_json_default)
        fh.write("\n")


def tree_commit(repo: Path = REPO) -> str | None:
    """``git rev-parse HEAD`` of ``repo``, with ``-dirty`` appended when a tracked file differs from it (the figures
    then came from code no commit holds); None where git or the repository is missing."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def cpu_label() -> str:
    """``<CPU model> (<torch's kernel capability>)``, e.g. ``AMD EPYC 7B13 (AVX2)``: the capability is what the
    kernels used (an ``ATEN_CPU_CAPABILITY`` restriction lowers it), the model what they ran on."""
    from infra.numerics import cpu_model

    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


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
    """Where and on what a benchmark ran: the machine (CPU model, torch's kernel capability, native bf16 and the
    start-up probe's bf16 speed-up, cores, any ISA restriction of the kernels), versions, threads, the load average at
    start, ``numerics`` (the dtypes the benchmark resolved, e.g. ``Numerics.params()``) and the commit the code came
    from (:func:`tree_commit`, which :func:`write_result` puts first)."""
    import transformers

    from infra.numerics import device_facts

    facts = device_facts("cpu")
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
        "commit": tree_commit(),
    }


ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Environment variables that hold torch's kernels below the CPU's ISA (how an AMX machine imitates an AVX2 one)."""


def machine_label(env: Mapping[str, Any]) -> str:
    """``<cpu> (<capability>[, kernels held to …])`` for a table's title: every figure names where it came from."""
    held = env.get("isa_restrictions") or {}
    restriction = f", kernels held to {'/'.join(sorted(set(held.values())))}" if held else ""
    return f"{env.get('cpu', '?')} ({env.get('capability', '?')}{restriction})"


def closing_line(results: Mapping[str, Any], threads: int, out: Path) -> str:
    """A timing bench's last line: where it ran, how long, its threads, the load average at start and end (its
    ``environment``'s ``load_avg_start`` / ``load_avg_end``) and where the JSON went."""
    env = results["environment"]
    return (f"\non {machine_label(env)}: total {results['total_s']:.0f} s; torch threads {threads}; "
            f"load avg {env['load_avg_start'][0]:.1f} → {env['load_avg_end'][0]:.1f}; wrote {out}")


def default_compute(model_name: str) -> str:
    """A benchmark's autocast dtype when ``--compute`` is not given: float32 for tiny-random (exact, and faster
    than autocast for 3M parameters), else what ``auto`` resolves to on this CPU (bf16 only where it is fast)."""
    from infra.models import TINY_RANDOM
    from infra.numerics import auto_dtype, device_facts

    return "float32" if model_name == TINY_RANDOM else auto_dtype(device_facts("cpu"))


# The libraries a timing bench keeps to warnings: their per-step INFO lines would swamp its own.
QUIET_LOGGERS = ("transformers", "infra", "aepo_core", "bm25s")


def cli_logging(quiet: bool = False) -> None:
    """A bench run from the command line logs INFO and up to stderr, each line with its time and logger;
    ``quiet``: :data:`QUIET_LOGGERS` only from WARNING."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for name in QUIET_LOGGERS if quiet else ():
        logging.getLogger(name).setLevel(logging.WARNING)


def flow_bench_main(prog: str, runs_dir: Path, body: Callable[[Path], int],
                    errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a bench whose work is flows: INFO logging, the runs dir's environment (set before Prefect is imported),
    Prefect's temporary server bound to this process (a SIGKILLed bench leaves no orphan), SIGTERM unwinding
    (that server and a vLLM server stop with it), then ``body(runs)``; one of :data:`tasks.retry.USER_ERRORS` (a bad
    config, a sweep another process is running) or of ``errors`` is one line on stderr and exit code 2."""
    cli_logging()
    from flows.cli.environment import prepare_environment, sigterm_unwinds, start_prefect_api
    from tasks.retry import USER_ERRORS

    runs = runs_dir.resolve()
    prepare_environment(runs)
    start_prefect_api()
    try:
        with sigterm_unwinds():
            return body(runs)
    except (*USER_ERRORS, *errors) as exc:  # a bad config, override or input: one line (the server stops at exit)
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
