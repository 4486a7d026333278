"""Matmul speed per dtype on this CPU: what ``auto`` numerics decide from, and how an AMX machine imitates AVX2.

    python -m bench.numerics                                   # this CPU as it is
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m bench.numerics --out bench/results/numerics-avx2.json

Times ``F.linear`` of SmolLM2-135M's MLP shape (512×576 @ 576×1536, the figure the portable-numerics issue quotes
from an AMD EPYC: 1.2 GFLOP/s in bf16 against 37.6 in float32, one thread) and of the start-up probe's shape, in
float32 and bf16, on one thread and on all cores; plus bf16 autocast over float32 weights (what training runs) and
what :func:`infra.numerics.device_facts` decides. Prints a table, writes JSON with the machine and the commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.harness import RESULTS_DIR, environment, machine_label, print_table, set_threads, write_result
from infra.numerics import PROBE_SHAPE, auto_dtype, device_facts

SHAPES = {"smollm2 mlp (512×576 @ 576×1536)": (512, 576, 1536), "probe": PROBE_SHAPE}
EPYC_AVX2 = {"float32": 37.6, "bfloat16": 1.2}
"""GFLOP/s of the SmolLM2 MLP shape on one thread of an AMD EPYC (AVX2 only), from the portable-numerics issue."""


def gflops(shape: tuple[int, int, int], mode: str, seconds: float = 1.0) -> float:
    """GFLOP/s of ``F.linear`` at ``shape`` in ``mode`` (float32, bfloat16, or autocast: bf16 autocast over float32
    weights), the median of timed calls after a warm-up, for about ``seconds``."""
    rows, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    if mode == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()

    def call() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            torch.nn.functional.linear(x, w)

    with torch.no_grad():
        call()
        times: list[float] = []
        start = time.perf_counter()
        while not times or (time.perf_counter() - start < seconds and len(times) < 200):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return 2 * rows * k * n / statistics.median(times) / 1e9


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.0, help="timing per (shape, dtype, threads)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/numerics.json)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cores = torch.get_num_threads()
    facts = device_facts("cpu")
    env = environment(cores)
    rows: list[dict[str, Any]] = []
    for threads in sorted({1, cores}):
        set_threads(threads)
        for label, shape in SHAPES.items():
            speed = {mode: gflops(shape, mode, args.seconds) for mode in ("float32", "bfloat16", "autocast")}
            rows.append({"shape": label, "threads": threads, **{f"{m}_gflops": v for m, v in speed.items()},
                         "bf16_vs_float32": speed["bfloat16"] / speed["float32"]})
    results = {"benchmark": "numerics", "environment": env, "decision": {
        "native_bf16": facts.native_bf16, "bf16_speedup_probe": facts.bf16_speedup, "auto": auto_dtype(facts)},
        "reference_epyc_avx2_1thread": EPYC_AVX2, "rows": rows}
    out = args.out or RESULTS_DIR / "numerics.json"
    write_result(out, results)
    print_table(f"matmul GFLOP/s on {machine_label(env)}: auto → {auto_dtype(facts)}",
                ["shape", "threads", "float32", "bf16", "bf16 autocast", "bf16 ÷ float32"],
                [[r["shape"], r["threads"], r["float32_gflops"], r["bfloat16_gflops"], r["autocast_gflops"],
                  r["bf16_vs_float32"]] for r in rows])
    print(f"reference, AMD EPYC (AVX2 only), one thread, smollm2 mlp: float32 {EPYC_AVX2['float32']}, bf16 "
          f"{EPYC_AVX2['bfloat16']} GFLOP/s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
