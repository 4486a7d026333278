"""What each rollout feature would save a paper-scale run, on paper (issue 56 §4): Qwen3-14B on one 8-GPU node with
the paper's rollout shape (``configs/paper/qwen3_14b_deepsearch.yaml``: 64 questions × k = 12 trajectories a step,
up to 6 tool calls, 5 epochs of 1k questions) and a deep-search tool mix.

A model, not a measurement: every input below is an assumption, named with its value, and the output is only as good
as they are. Tool latencies are drawn (seeded) from log-normals with the stated mean and p99
(:func:`aepo_core.tool_latency.lognormal_params`); a step's parts:

- **decode**: a segment of L tokens takes L × the decode step latency (lockstep decoding of a large batch), and the
  engine's throughput bounds the whole rollout from below (tokens / throughput);
- **rounds** (the round-synchronous loop): each of the rollout's tool rounds waits for its longest segment, then for
  its slowest call among all of that round's calls;
- **per_path** (``rollout.scheduling: per_path``): each trajectory runs its own chain of segments and calls; the rollout
  lasts as long as its longest chain (or the throughput bound, whichever is longer);
- **update**: (6 + 2) × parameters × tokens FLOPs (forward and backward, and the scoring pass) at the stated MFU;
- **overlap** (``train.max_staleness: 1``) needs the rollout and the update on separate GPUs: the node is split, 4
  GPUs sample and 4 train (the decode step latency is unchanged, the throughput and the update's FLOP/s halve), and
  a step lasts max(rollout, update) + the weight sync instead of their sum on all 8.

Run: ``.venv/bin/python -m bench.paper_cost [--out bench/results/paper_cost.json]`` (seconds, any CPU).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aepo_core.tool_latency import lognormal_params
from bench.harness import RESULTS_DIR, print_table, write_result


@dataclass(frozen=True)
class Assumptions:
    """The inputs of the model (assumptions where not the paper config's)."""

    trajectories: int = 64 * 12  # paper config: batch_size 64 × k 12
    steps: int = 5 * 1000 // 64  # 5 epochs of hard_search_1k
    params: float = 14.8e9  # Qwen3-14B
    tool_calls: int = 4  # calls per trajectory (the config allows 6)
    segment_tokens: int = 600  # generated tokens per segment: 5 segments ≈ 3,000 of the 6,192 allowed
    longest_segment: float = 1.6  # the longest segment of a round, in units of segment_tokens
    prompt_tokens: int = 1500  # the prompt and tool results per trajectory (trained on, not generated)
    decode_step_s: float = 0.030  # one lockstep decode step of a large batch, 14B bf16 on an H100
    tokens_per_s_per_gpu: float = 3000.0  # vLLM decode throughput per H100 at large batch
    gpus: int = 8
    peak_flops_per_gpu: float = 989e12  # H100 SXM dense bf16
    mfu: float = 0.35
    weight_sync_s: float = 10.0  # 28 GB of bf16 weights from the trainer to the engine
    tool_mix: tuple[tuple[str, float, float, float], ...] = (
        ("search", 0.5, 1.5, 5.0),  # (tool, share of calls, mean s, p99 s): a web-search API
        ("browse", 0.3, 10.0, 30.0),  # a page fetch summarised by a reader model
        ("python", 0.2, 0.5, 3.0),  # a sandbox under load
    )


def _draw_call(rng: random.Random, a: Assumptions) -> float:
    u, acc = rng.random(), 0.0
    for _tool, share, mean, p99 in a.tool_mix:
        acc += share
        if u <= acc:
            mu, sigma = lognormal_params(mean, p99)
            return rng.lognormvariate(mu, sigma)
    raise AssertionError("tool shares must sum to 1")


def rollout_seconds(a: Assumptions, scheduling: str, gpus: int, rng: random.Random) -> dict[str, float]:
    """One step's rollout: wall seconds, of which waiting on tools with nothing to decode, and the throughput bound."""
    n, segments = a.trajectories, a.tool_calls + 1
    tokens = n * segments * a.segment_tokens
    floor = tokens / (a.tokens_per_s_per_gpu * gpus)
    if scheduling == "rounds":
        decode = segments * a.segment_tokens * a.longest_segment * a.decode_step_s
        tools = sum(max(_draw_call(rng, a) for _ in range(n)) for _ in range(a.tool_calls))
        return {"wall_s": max(decode, floor) + tools, "tool_wait_s": tools, "floor_s": floor}
    chains = []
    for _ in range(n):
        lengths = [a.segment_tokens * rng.uniform(0.4, a.longest_segment) for _ in range(segments)]
        chains.append(sum(lengths) * a.decode_step_s + sum(_draw_call(rng, a) for _ in range(a.tool_calls)))
    wall = max(max(chains), floor)
    return {"wall_s": wall, "tool_wait_s": max(0.0, wall - floor), "floor_s": floor}


def update_seconds(a: Assumptions, gpus: int) -> float:
    tokens = a.trajectories * (a.prompt_tokens + (a.tool_calls + 1) * a.segment_tokens)
    return 8 * a.params * tokens / (gpus * a.peak_flops_per_gpu * a.mfu)


def variants(a: Assumptions, seed: int = 0, reps: int = 20) -> list[dict[str, Any]]:
    """Step and run time of the four combinations of scheduling and overlap (means over ``reps`` drawn steps)."""
    out = []
    for scheduling in ("rounds", "per_path"):
        for overlap in (False, True):
            rng = random.Random(f"{seed}-{scheduling}")  # the same draws with and without overlap
            roll_gpus = a.gpus // 2 if overlap else a.gpus
            rolls = [rollout_seconds(a, scheduling, roll_gpus, rng) for _ in range(reps)]
            rollout = sum(r["wall_s"] for r in rolls) / reps
            tool_wait = sum(r["tool_wait_s"] for r in rolls) / reps
            update = update_seconds(a, a.gpus - roll_gpus if overlap else a.gpus)
            step = (max(rollout, update) if overlap else rollout + update) + a.weight_sync_s
            out.append({"scheduling": scheduling, "max_staleness": int(overlap), "rollout_s": rollout,
                        "tool_wait_s": tool_wait, "update_s": update, "step_s": step,
                        "run_h": step * a.steps / 3600})
    base = out[0]["step_s"]
    for row in out:
        row["speedup"] = base / row["step_s"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.paper_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "paper_cost.json")
    args = p.parse_args(argv)
    a = Assumptions()
    rows = variants(a)
    print_table(f"paper-scale step on one 8-GPU node, a model ({a.trajectories} trajectories, {a.steps} steps)",
                ["scheduling", "max_staleness", "rollout s", "of it tools s", "update s", "step s", "run h", "×"],
                [[r["scheduling"], r["max_staleness"], r["rollout_s"], r["tool_wait_s"], r["update_s"], r["step_s"],
                  r["run_h"], r["speedup"]] for r in rows])
    write_result(args.out, {"assumptions": asdict(a), "variants": rows, "model": "bench/paper_cost.py (not measured)",
                            "expected_max_call_s": _expected_max(a)})
    return 0


def _expected_max(a: Assumptions) -> float:
    """E[the slowest of a round's calls] under the mix (one round of every trajectory's call), for the README."""
    rng = random.Random(1)
    return sum(max(_draw_call(rng, a) for _ in range(a.trajectories)) for _ in range(200)) / 200


if __name__ == "__main__":
    raise SystemExit(main())
