"""Rollouts beside the update (issue 56 §3–4): RL step wall time on-policy (``train.max_staleness`` 0, the baseline,
measured in the same run) and overlapped (1), at the tool latencies of :mod:`bench.rollout_latency`.

Every arm is a real train flow (Prefect engine, MLflow) from one policy that calls tools: the cold-start SFT start
of the testbed regime (``configs/sweeps/testbed.yaml``: varied transcripts, SFT lr 7e-5), trained once and cached by
:func:`bench.compare_algorithms.shared_sft_checkpoint`; the same questions and seeds; no evaluation but a one-question
final one, no checkpoint before the last step. Per arm, over the steps after the first (an overlapped run samples its
first two steps' rollouts before it can overlap anything): the mean step wall time (``step/wall_s``), the rollouts'
and the update's own wall time, the part of a step spent waiting for its rollouts (``time/rollout_wait_s``;
on-policy, the whole rollout), the staleness of the update's tokens, and the step time against on-policy at the same
latency. Arms run interleaved by latency, so a load drift hits both of a pair.

Run: ``.venv/bin/python -m bench.overlap [--steps 4] [--latencies zero moderate] [--set key=value ...]
[--out bench/results/overlap.json]`` (~25 min on 2 idle Zen 4 cores for the default two latencies). With a vLLM
server on a core of its own (``make vllm`` first): ``--set rollout.engine=vllm --server-core 1``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.compare_algorithms import shared_sft_checkpoint
from bench.harness import RESULTS_DIR, environment, flow_bench_main, machine_label, print_table, write_result
from bench.rollout_latency import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
REGIME = ["train.sft.varied=true", "train.sft.lr=7e-5"]
"""The testbed's cold start (its shared SFT start is cached under the same key)."""
ARM = ["train.batch_size=8", "optim.mini_batch_size=4", "eval.at_start=false", "eval.max_questions=1",
       "eval.n_samples=1", "eval.pass_k=1", "tracking.log_model=false", "tracking.system_metrics=false",
       "algorithm.dynamic_sampling=false", "tools.cache=false"]
"""What every arm shares: 8 questions a step in 2 optimizer steps, next to no evaluation, every tool call delayed
(uncached)."""
KEYS = {"step_s": "step/wall_s", "rollout_s": "time/rollout_s", "update_s": "time/update_s",
        "wait_s": "time/rollout_wait_s", "staleness": "rollout/staleness_mean", "tool_calls": "rollout/tool_calls_mean"}


def latency_sets(name: str) -> list[str]:
    """The overrides that put both tools behind the latency setting ``name`` of :data:`SETTINGS`."""
    latency = SETTINGS[name]
    return [f"tools.{tool}.latency.{key}={value}" for tool in ("search", "python")
            for key, value in latency.model_dump().items() if value is not None]


def arm_figures(tracking_uri: str, run_id: str) -> dict[str, float]:
    """Means over the steps after the first of :data:`KEYS` (``wait_s`` on-policy: the rollout itself)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    out: dict[str, float] = {}
    for name, key in KEYS.items():
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        values = [m.value for m in history if m.step > 1]
        out[name] = statistics.fmean(values) if values else float("nan")
    if out["wait_s"] != out["wait_s"]:  # NaN: on-policy, a step waits for all of its rollouts
        out["wait_s"] = out["rollout_s"]
    return out


def run(args: argparse.Namespace, runs: Path) -> int:
    from flows.train import train
    from infra.config_files import load_config

    sets = [*REGIME, *args.set]
    policy, _ = shared_sft_checkpoint(load_config(DEMO, sets), runs)
    env = environment(torch.get_num_threads())
    arms: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for latency in args.latencies:
        for staleness in args.staleness:
            name = f"{latency}-s{staleness}"
            cfg = load_config(DEMO, [*sets, *ARM, f"model.name={policy}", "train.sft.enabled=false",
                                     f"train.steps={args.steps}", f"checkpoint.every={args.steps}",
                                     f"train.max_staleness={staleness}", *latency_sets(latency)])
            out = train(config=cfg, runs_dir=str(runs / name), run_name=f"overlap-{name}")
            arms.append({"arm": name, "latency": latency, "max_staleness": staleness,
                         **arm_figures(out.tracking_uri, out.run_id)})
    for arm in arms:
        base = next(a for a in arms if a["latency"] == arm["latency"] and a["max_staleness"] == 0)
        arm["step_vs_on_policy"] = arm["step_s"] / base["step_s"]
    env["load_avg_end"] = list(os.getloadavg())
    results = {"environment": env, "steps": args.steps, "sets": sets, "arms": arms,
               "total_s": time.perf_counter() - t0,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print_table(f"rollouts beside the update on {machine_label(env)} (means over steps 2–{args.steps})",
                ["arm", "step s", "rollout s", "update s", "waited s", "staleness", "tool calls", "× on-policy"],
                [[a["arm"], a["step_s"], a["rollout_s"], a["update_s"], a["wait_s"], a["staleness"],
                  a["tool_calls"], a["step_vs_on_policy"]] for a in arms])
    write_result(args.out, results)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="RL steps per arm (the first is not averaged)")
    p.add_argument("--latencies", nargs="+", choices=sorted(SETTINGS), default=["zero", "moderate"])
    p.add_argument("--staleness", nargs="+", type=int, default=[0, 1], help="train.max_staleness arms (0: baseline)")
    p.add_argument("--set", action="append", default=[], help="an override of every arm's config, key=value")
    p.add_argument("--server-core", type=int, default=None,
                   help="with --set rollout.engine=vllm: the core the vLLM server runs on alone (this process keeps "
                   "the others)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs/bench-overlap"))
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "overlap.json")
    args = p.parse_args(argv)
    if 0 not in args.staleness:
        p.error("--staleness needs 0: the on-policy baseline every arm is compared with")
    return args


def own_core_for_server(core: int) -> list[int]:
    """Give a vLLM server started from here CPU core ``core`` alone: its OpenMP threads are bound there
    (``VLLM_CPU_OMP_THREADS_BIND``, which the server inherits), and this process (the trainer, the exact-entropy
    scorer, Prefect's threads) with its torch threads is kept to the other cores, which it returns."""
    others = sorted(os.sched_getaffinity(0) - {core})
    if core not in os.sched_getaffinity(0) or not others:
        raise ValueError(f"--server-core {core}: needs a core of this process and at least one other "
                         f"(have {sorted(os.sched_getaffinity(0))})")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.sched_setaffinity(0, others)
    torch.set_num_threads(len(others))
    return others


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server_core is not None:
        own_core_for_server(args.server_core)
    return flow_bench_main("bench.overlap", args.runs_dir, lambda runs: run(args, runs))


if __name__ == "__main__":
    raise SystemExit(main())
