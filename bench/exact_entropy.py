"""Exact entropies on the vLLM engine (issue 26 §4): what they cost, and how often the top-k estimate would decide
otherwise.

One aepo rollout of the tool-calling SmolLM2 (bench/rollout.py's cold-start SFT policy, cached) on a managed vLLM
server (bf16, eager, 20 top log-probs), through :class:`~infra.engines.exact_entropy.ExactEntropyEngine`: every
segment carries both the exact full-vocabulary entropies (the policy's forward in this process, what the rules
read) and the estimate from the server's top-20 log-probs (the uniform tail), recorded here.  Reported:

- **cost**: seconds in the exact forward (``HFEngine.score``) against seconds in the server's generate calls, and
  the tokens the forward fed (prefilled) against those the server generated (KV reuse makes this ≈ 1 + tool tokens);
- **agreement**: per branch decision the probability, over the decision's uniform draw u, that the estimate would
  have decided otherwise: |clip(τ/f − γ·ΔH_exact) − clip(τ/f − γ·ΔH_estimate)| with f the penalty factor (a
  decision branches iff u ≥ τ/f − γ·ΔH); the expected agreement is 1 − its mean.  Per question, whether m from the
  probe's estimated entropies equals m from its exact ones;
- the mean segment entropy (first W tokens) both ways.

Run: ``.venv/bin/python -m bench.exact_entropy [--questions 32] [--k 8] [--threads 2]`` (needs ``make vllm``).
Writes ``bench/results/exact_entropy.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aepo_core.config import RemoteEngineConfig, RolloutConfig
from aepo_core.entropy import segment_entropy
from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from aepo_core.rollout.budget import global_budget, mean_tool_entropy
from aepo_core.rollout.scheduler import RolloutScheduler
from aepo_core.rollout.tree import Node, RolloutTree, is_tool_step
from bench.harness import RESULTS_DIR, cli_logging, environment, print_table, set_threads, write_result
from bench.rollout import (
    TASK_KW,
    ToolPolicy,
    _start_vllm,
    bench_questions,
    build_bench_tools,
    model_config,
    tool_policy,
)
from infra.data.synthetic import SyntheticTask
from infra.engines.exact_entropy import ExactEntropyEngine
from infra.engines.hf import HFEngine
from infra.engines.remote import RemoteEngine, export_hf_checkpoint
from infra.models import BUILTIN_SMOLLM2, load_policy
from infra.numerics import autocast_dtype

log = logging.getLogger("bench.exact_entropy")

class Recording(ExactEntropyEngine):
    """The exact-entropy engine, keeping each result's estimated entropies and timing the two halves."""

    def __init__(self, inner: RemoteEngine, scorer: HFEngine) -> None:
        super().__init__(inner, scorer)
        self.estimates: dict[tuple[int, ...], list[tuple[list[int], list[float]]]] = {}
        self.server_s = self.score_s = 0.0
        self.generated = self.fed = self.reused = 0

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        t0 = time.perf_counter()
        raw = self.inner.generate(requests, sampling)
        t1 = time.perf_counter()
        ok = [i for i, r in enumerate(raw) if r.error is None]
        scored = self.scorer.score([(requests[i].prompt_ids, raw[i].token_ids) for i in ok], sampling)
        self.server_s += t1 - t0
        self.score_s += time.perf_counter() - t1
        self.fed += self.scorer.last_stats.prefill_tokens
        self.reused += self.scorer.last_stats.reused_tokens
        out = list(raw)
        for i, entropies in zip(ok, scored, strict=True):
            self.generated += len(raw[i].token_ids)
            self.estimates.setdefault(tuple(requests[i].prompt_ids), []).append(
                (list(raw[i].token_ids), list(raw[i].entropies)))
            out[i] = dataclasses.replace(raw[i], entropies=entropies, entropy_is_estimate=False)
        return out

    def estimate(self, prompt: Sequence[int], node: Node, window: int) -> float:
        """The estimated segment entropy of ``node`` sampled after ``prompt`` (its first W tokens)."""
        for tokens, entropies in self.estimates.get(tuple(prompt), []):
            if tokens[: len(node.token_ids)] == node.token_ids:
                return segment_entropy(entropies[: len(node.token_ids)], window)
        raise KeyError(f"no recorded result for node {node.node_id}")


def _threshold(delta: float, penalty: float, cfg: RolloutConfig) -> float:
    """The u above which a decision branches, clipped to [0, 1] (1: never)."""
    if penalty <= 0:
        return 1.0
    return min(1.0, max(0.0, cfg.tau / penalty - cfg.gamma * delta))


def agreement(trees: Sequence[RolloutTree], engine: Recording, cfg: RolloutConfig) -> dict[str, Any]:
    """Decision-disagreement probabilities, m agreement and mean segment entropies (module docstring)."""
    flips: list[float] = []
    exact_h: list[float] = []
    est_h: list[float] = []
    m_same = 0
    for tree in trees:
        est: dict[int, float] = {}
        for node in tree.nodes:
            if node.kind != "model":
                continue
            path = tree.ancestors(node)
            prompt = [t for n in path[:-1] for t in n.token_ids]
            est[node.node_id] = engine.estimate(prompt, node, cfg.entropy_window)
            if not math.isnan(node.segment_entropy):
                exact_h.append(node.segment_entropy)
                est_h.append(est[node.node_id])
        for node in tree.nodes:
            if node.branch_reason not in ("branch", "below_tau", "penalized", "budget_full"):
                continue
            first = next(n for n in tree.ancestors(node) if n.kind == "model")
            penalty = max(0.0, 1.0 - cfg.branch_penalty * node.consecutive_branches)
            delta_est = est[node.node_id] - est[first.node_id]
            flips.append(abs(_threshold(node.delta_entropy, penalty, cfg) - _threshold(delta_est, penalty, cfg)))
        probe = [tree.nodes[i] for i in tree.leaves[0].node_ids if tree.nodes[i].kind == "model"]
        h_root = est[probe[0].node_id]
        h_tool = mean_tool_entropy(h_root, [est[n.node_id] for n in probe if is_tool_step(tree.nodes, n)])
        m_same += global_budget(cfg.k, h_root, h_tool, cfg.beta) == tree.global_budget
    return {
        "decisions": len(flips),
        "expected_decision_agreement": 1.0 - statistics.fmean(flips) if flips else math.nan,
        "decisions_certain_to_agree": sum(f == 0.0 for f in flips),
        "questions": len(trees), "m_agreement": m_same / len(trees),
        "segment_entropy_exact_mean": statistics.fmean(exact_h),
        "segment_entropy_estimate_mean": statistics.fmean(est_h),
        "segments": len(exact_h),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: torch's default)")
    p.add_argument("--compute", default="float32", help="the exact forward's compute dtype (default %(default)s)")
    p.add_argument("--model-cache", default=None)
    p.add_argument("--policy", type=Path, default=None,
                   help="a policy checkpoint directory (e.g. the rollout study's shared SFT start) instead of "
                        "bench/rollout.py's 4-step SFT")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--sft-batch", type=int, default=4)
    p.add_argument("--sft-lr", type=float, default=2e-5)
    p.add_argument("--no-sft-cache", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "exact_entropy.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cli_logging()
    if args.threads:
        set_threads(args.threads)
    env = environment(threads=args.threads)
    task = SyntheticTask(**TASK_KW)
    workdir = Path(tempfile.mkdtemp(prefix="bench-exact-"))
    if args.policy is not None:
        model, tokenizer = load_policy(model_config(str(args.policy), args.model_cache))
        policy = ToolPolicy(model, tokenizer, args.policy.name, None)
    else:
        model, tokenizer = load_policy(model_config(BUILTIN_SMOLLM2, args.model_cache))
        policy = tool_policy(BUILTIN_SMOLLM2, model, tokenizer, args.compute, args, task, workdir)
    model_dir = export_hf_checkpoint(policy.model, policy.tokenizer, workdir / "vllm-policy")
    server, start_s = _start_vllm(model_dir, workdir / "vllm.log", eager=True, cache_root=None)
    try:
        served = RemoteEngineConfig(url=server.url, model=server.served_name, weight_sync="vllm", top_logprobs=20)
        remote = RemoteEngine(served, policy.tokenizer, receiver=server.control)
        scorer = HFEngine(policy.model, policy.tokenizer, seed=args.seed, autocast_dtype=autocast_dtype(args.compute),
                          kv_reuse_mb=1024.0)
        engine = Recording(remote, scorer)
        cfg = RolloutConfig(mode="aepo", k=args.k, initial_rollouts=args.k // 2, max_tool_calls=3,
                            max_response_tokens=512, max_result_chars=600)
        questions = bench_questions(task, policy.tokenizer, args.questions)
        tools = build_bench_tools(task.documents(), workdir, None)
        t0 = time.perf_counter()
        result = RolloutScheduler(engine, tools, cfg).run(questions, seed=args.seed)
        wall = time.perf_counter() - t0
        remote.close()
    finally:
        server.close()
    agree = agreement(result.trees, engine, cfg)
    cost = {"rollout_wall_s": wall, "server_generate_s": engine.server_s, "exact_forward_s": engine.score_s,
            "exact_share_of_engine_time": engine.score_s / (engine.score_s + engine.server_s),
            "tokens_generated": engine.generated, "tokens_fed_to_exact_forward": engine.fed,
            "tokens_reused_from_kv": engine.reused, "vllm_start_s": start_s}
    print_table(f"Exact entropies on vLLM: aepo, {len(questions)} questions, k = {args.k}, policy {policy.label}",
                ["quantity", "value"],
                [["rollout wall s", f"{wall:.1f}"], ["server generate s", f"{engine.server_s:.1f}"],
                 ["exact forward s", f"{engine.score_s:.1f} ({cost['exact_share_of_engine_time']:.0%} of engine)"],
                 ["tokens generated / fed / reused", f"{engine.generated} / {engine.fed} / {engine.reused}"],
                 ["segment entropy, exact vs estimate (nats)",
                  f"{agree['segment_entropy_exact_mean']:.3f} vs {agree['segment_entropy_estimate_mean']:.3f}"],
                 ["expected decision agreement (estimate vs exact)",
                  f"{agree['expected_decision_agreement']:.4f} over {agree['decisions']} decisions"],
                 ["m agreement (questions)", f"{agree['m_agreement']:.3f} of {agree['questions']}"]])
    write_result(args.out, {"benchmark": "exact_entropy", "environment": env, "questions": len(questions),
                            "k": args.k, "policy": policy.label, "cost": cost, "agreement": agree,
                            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
