"""Train-step benchmark (issue 4): PolicyUpdater tokens/s vs a raw forward+backward, padding, memory, checkpoints.

Samples are realistic RL samples: the rollout prompt (system prompt + synthetic question through the chat
template, ~120 tokens) and an oracle response written with the real tools (BM25 search, Python sandbox), whose
tool-result spans are masked out (loss mask 0); rollout log-probs are random, advantages are GRPO-normalized
random rewards over groups of k. For each model, in a fresh subprocess (so peak RSS is the model's own):

- ``PolicyUpdater.update`` (scoring pass + PPO mini-batches + AdamW step) vs a raw forward+backward of the same
  samples in the same token-budget micro-batches (HF ``model(input_ids, attention_mask, labels)`` with labels
  on response tokens, same autocast), interleaved. Target: updater tokens/s ≥ 0.8 × raw. Samples carry the
  engine's entropies, so this on-policy update (one epoch, one mini-batch) skips the scoring pass, as training
  with the in-process engine does; the off-policy path (``optim.scoring_pass=always``: a whole extra no-grad
  forward for π_old and entropies) is timed as a third arm.
- padding waste of the updater's micro-batches (and of one unsorted batch, for scale), peak RSS.
- ``save_checkpoint`` / ``load_checkpoint`` wall time (load with and without checksum verification) and size.
- peak RSS per phase (raw fwd+bwd, update, scoring pass, optimizer step, checkpoint save/load), sampled from
  /proc in a thread (:class:`PhaseRss`).
- the whole single-turn step of SmolLM2 (:func:`bench_step`, ``--step``, default on): HF-engine rollout + update
  vs raw ``model.generate`` + raw forward/backward, target ≤ 1.1×, and its peak RSS, target < 6 GiB.

Run: ``.venv/bin/python -m bench.train_step [--model tiny-random|smollm2-135m-instruct|both] [--quick]``.
Writes ``bench/results/train_step.json`` (``train_step-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import math
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from aepo_core.config import ExperimentConfig
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
from infra.data.synthetic import OracleError, SyntheticTask, oracle_transcript
from infra.models import BUILTIN_SMOLLM2, TINY_RANDOM, chat_prompt_ids, load_policy
from infra.numerics import GENERATION_DTYPES, autocast_dtype, numerics_for
from infra.run.sft import sft_sample
from infra.tools.sandbox.tool import PythonSandbox
from infra.tools.search import Bm25Backend, build_search_tool
from infra.training.backends import TorchBackend
from infra.training.batching import TrainSample, collate, plan_micro_batches
from infra.training.checkpoint import load_checkpoint, save_checkpoint
from infra.training.memory import checkpoint_decoder_layers
from infra.training.update import PolicyUpdater

log = logging.getLogger("bench.train_step")

MODELS = (TINY_RANDOM, BUILTIN_SMOLLM2)
TARGET_RATIO = 0.8
# (questions, k, interleaved reps) per (model, quick)
SIZES = {
    (TINY_RANDOM, False): (6, 4, 2),
    (TINY_RANDOM, True): (4, 4, 1),
    (BUILTIN_SMOLLM2, False): (2, 4, 2),
    (BUILTIN_SMOLLM2, True): (1, 4, 1),
}


# ----------------------------------------------------------------------------------------------------- helpers
def rss_mb() -> float:
    """Current resident set size (MB), from /proc (Linux) or psutil."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhaseRss:
    """Samples this process's RSS (/proc VmRSS) every ``interval_s`` in a thread and charges each sample to the
    innermost open phase: the peak (MB) of every phase (``with rss("update"):``), nested phases included in their
    parents. ``getrusage`` maxrss cannot do this: it only ever grows."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}
        self._open: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _note(self) -> None:
        now = rss_mb()
        for name in list(self._open):
            self.peaks[name] = max(self.peaks.get(name, 0.0), now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._note()
            self._stop.wait(self.interval_s)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._open.append(name)
        self._note()
        try:
            yield
        finally:
            self._note()
            self._open.remove(name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class TimedBackend:
    """Backend proxy that times the optimizer step (clip + AdamW + schedule) of the wrapped backend."""

    def __init__(self, backend: TorchBackend, rss: PhaseRss) -> None:
        self.inner = backend
        self.compute_dtype = backend.compute_dtype
        self.device = backend.device
        self.chunked_projection = backend.chunked_projection
        self.shares_tree = backend.shares_tree
        self.ranks = backend.ranks
        self.rss = rss
        self.step_s = 0.0

    @property
    def module(self) -> torch.nn.Module:
        return self.inner.module

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.inner.forward_hidden(input_ids, attention_mask)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def step(self) -> float:
        t0 = time.perf_counter()
        with self.rss("optimizer step"):
            norm = self.inner.step()
        self.step_s += time.perf_counter() - t0
        return norm

    def current_lr(self) -> float:
        return self.inner.current_lr()


class PhasedUpdater(PolicyUpdater):
    """The updater with its scoring pass charged to the ``scoring pass`` phase."""

    def __init__(self, backend: TimedBackend, cfg: ExperimentConfig, pad_id: int) -> None:
        super().__init__(backend, cfg, pad_id)  # type: ignore[arg-type]
        self.rss = backend.rss

    def score(self, samples: Sequence[TrainSample], policy: bool = True) -> Any:
        with self.rss("scoring pass"):
            return super().score(samples, policy)


# ----------------------------------------------------------------------------------------------------- samples
def build_samples(tokenizer: Any, questions: int, k: int, seed: int, workdir: Path) -> list[TrainSample]:
    """``questions × k`` samples from oracle transcripts (real tool results, masked), GRPO advantages per group."""
    task = SyntheticTask(n_companies=40)  # all three families: one to three tool calls, Python included
    search = build_search_tool(SearchToolConfig(top_k=3, snippet_chars=200), timeout_s=10.0,
                               backend=Bm25Backend(task.documents(), workdir / "index"))
    python = PythonSandbox(PythonToolConfig(cpu_seconds=5), timeout_s=10.0)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(seed)
    rows = task.questions("train")
    rng.shuffle(rows)
    out: list[TrainSample] = []
    for row in rows:
        if len(out) >= questions * k:
            break
        try:
            segments = oracle_transcript(row, lambda q: search(q).text, lambda c: python(c).text,
                                         max_result_chars=400)
        except OracleError:
            continue
        prompt = chat_prompt_ids(tokenizer, row.question)
        s = sft_sample(prompt, segments, encode)
        logprobs = [-rng.uniform(0.0, 3.0) if m else 0.0 for m in s.loss_mask]
        # The in-process engine's exact entropies come with every sample (what lets on-policy updates skip the
        # scoring pass); their values do not matter for speed.
        entropies = [rng.uniform(0.0, 3.0) if m else 0.0 for m in s.loss_mask]
        out.append(replace(s, rollout_logprobs=logprobs, rollout_entropies=entropies, group=len(out) // k))
    rewards = [rng.random() for _ in out]
    final = []
    for g in range(questions):
        idx = [i for i, s in enumerate(out) if s.group == g]
        rs = [rewards[i] for i in idx]
        mean, std = statistics.fmean(rs), statistics.pstdev(rs)
        final += [replace(out[i], advantage=(rewards[i] - mean) / (std + 1e-6)) for i in idx]
    return final


# --------------------------------------------------------------------------------------------------- measuring
def raw_forward_backward(model: Any, samples: Sequence[TrainSample], pad_id: int, budget: int,
                         compute: torch.dtype | None) -> float:
    """Seconds for a plain HF forward+backward (CE on response tokens) over the updater's micro-batches."""
    model.train()
    t0 = time.perf_counter()
    for mb in plan_micro_batches([len(s.input_ids) for s in samples], budget):
        batch = collate([samples[i] for i in mb], pad_id)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        for row, i in enumerate(mb):
            labels[row, : samples[i].prompt_len] = -100
        with torch.autocast(batch.input_ids.device.type, dtype=compute or torch.float32, enabled=compute is not None):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
        out.loss.backward()
    wall = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    model.eval()
    return wall


def bench_model(name: str, args_dict: dict[str, Any]) -> dict[str, Any]:
    """Everything for one model (run in a fresh process so that peak RSS is this model's)."""
    args = argparse.Namespace(**args_dict)
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    cli_logging(quiet=True)
    compute_name = args.compute or default_compute(name)
    compute = autocast_dtype(compute_name)
    questions, k, reps = SIZES[(name, args.quick)]
    reps = args.reps or reps
    rss_start = rss_mb()
    cfg = ExperimentConfig.model_validate({
        "model": {"name": name, "dtype": "float32", "compute_dtype": compute_name, "cache_dir": args.model_cache},
        "rollout": {"k": k, "initial_rollouts": min(k, 2), "max_response_tokens": 512, "temperature": 1.0},
        "optim": {"lr": 1e-6, "mini_batch_size": questions, "micro_batch_tokens": args.micro_batch_tokens,
                  "ppo_epochs": 1},
        "algorithm": {"loss": "aepo", "entropy_advantage": True},
        "checkpoint": {"keep": 2},
    })
    t0 = time.perf_counter()
    model, tokenizer = load_policy(cfg.model)
    load_s = time.perf_counter() - t0  # first load in a fresh process: imports and tokenizer included
    t0 = time.perf_counter()
    again, _ = load_policy(cfg.model)
    reload_s = time.perf_counter() - t0  # from the converted-model cache, imports warm
    del again
    rss_model = rss_mb()
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    with tempfile.TemporaryDirectory(prefix="aepo-bench-train-") as tmp:
        workdir = Path(tmp)
        samples = build_samples(tokenizer, questions, k, args.seed, workdir)
        tokens = sum(len(s.input_ids) for s in samples)
        lengths = [len(s.input_ids) for s in samples]
        prompt_lens = [s.prompt_len for s in samples]
        resp_lens = [s.response_len for s in samples]
        masked = sum(s.response_len - sum(s.loss_mask) for s in samples) / max(1, sum(resp_lens))
        rss = PhaseRss()
        backend = TimedBackend(TorchBackend(model, cfg.optim, total_steps=1000, compute_dtype=compute), rss)
        updater = PhasedUpdater(backend, cfg, pad_id=pad)
        # The off-policy path (PPO epochs > 1, several mini-batches, remote engines): the scoring pass runs.
        scored_cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"scoring_pass": "always"})})
        scored_updater = PhasedUpdater(backend, scored_cfg, pad_id=pad)
        budget = updater.micro_batch_tokens  # micro_batch_tokens capped by optim.memory_budget_gb; raw uses it too

        log.info("[%s] %d samples, %d tokens; warm-up", name, len(samples), tokens)
        warm = [replace(samples[0], advantage=1.0)]
        raw_forward_backward(model, warm, pad, budget, compute)
        updater.update(warm)  # also allocates AdamW state (a one-time cost)
        rss_warm = rss_mb()

        reps_out = []
        for rep in range(reps):
            order = ("raw", "update", "scored") if rep % 2 == 0 else ("scored", "update", "raw")
            got: dict[str, Any] = {}
            for what in order:
                if what == "raw":
                    with rss("raw fwd+bwd"):
                        got["raw_s"] = raw_forward_backward(model, samples, pad, budget, compute)
                elif what == "scored":
                    t1 = time.perf_counter()
                    with rss("update with scoring pass"):
                        metrics = scored_updater.update(samples)
                    got["scored_update_s"] = time.perf_counter() - t1
                    got["scored_scoring_s"] = metrics["train/scoring_pass_s"]
                    assert metrics["train/scoring_pass"] == 1.0
                else:
                    backend.step_s = 0.0
                    t1 = time.perf_counter()
                    with rss("update"):
                        metrics = updater.update(samples)
                    got["update_s"] = time.perf_counter() - t1
                    got["scoring_s"] = metrics["train/scoring_pass_s"]
                    got["scoring_pass_ran"] = metrics["train/scoring_pass"]
                    got["optimizer_step_s"] = backend.step_s
                    got["padding_waste"] = metrics["train/padding_waste"]
                    got["updater_reported_tok_s"] = metrics["train/tokens_per_s"]
            raw_tps = tokens / got["raw_s"]
            got["raw_tok_s"] = raw_tps
            got["update_tok_s"] = tokens / got["update_s"]
            got["ratio_total"] = got["update_tok_s"] / raw_tps
            got["ratio_with_scoring_pass"] = tokens / got["scored_update_s"] / raw_tps
            got["ratio_without_scoring"] = tokens / (got["update_s"] - got["scoring_s"]) / raw_tps
            train_s = got["update_s"] - got["scoring_s"] - got["optimizer_step_s"]
            got["ratio_fwd_bwd_only"] = tokens / train_s / raw_tps
            reps_out.append(got)
            log.info("[%s] rep %d: raw %.0f tok/s, update %.0f tok/s (scoring %.1f s of %.1f s)", name, rep,
                     raw_tps, got["update_tok_s"], got["scoring_s"], got["update_s"])
        rss_train = rss_mb()

        # checkpoints: two saves (one with --quick; keep=2 prunes nothing), loads with and without checksums
        ckpt_root = workdir / "ckpt"
        saves, loads, loads_verified, size = [], [], [], 0
        for step in (1,) if args.quick else (1, 2):
            t1 = time.perf_counter()
            with rss("checkpoint save"):
                path = save_checkpoint(ckpt_root, step, model=model, tokenizer=tokenizer, config=cfg,
                                       optimizer=backend.inner.optimizer, scheduler=backend.inner.scheduler, keep=2)
            saves.append(time.perf_counter() - t1)
            size = dir_size(path)
            t1 = time.perf_counter()
            load_checkpoint(path, model=model, optimizer=backend.inner.optimizer, scheduler=backend.inner.scheduler,
                            verify=False, config=cfg)
            loads.append(time.perf_counter() - t1)
            t1 = time.perf_counter()
            with rss("checkpoint load"):
                load_checkpoint(path, model=model, optimizer=backend.inner.optimizer,
                                scheduler=backend.inner.scheduler, verify=True, config=cfg)
            loads_verified.append(time.perf_counter() - t1)

    rss.close()
    naive_waste = 1 - tokens / (len(samples) * max(lengths))
    med = {key: statistics.median(r[key] for r in reps_out) for key in reps_out[0]}
    return {
        "model": name,
        "weights_dtype": "float32",
        "compute_dtype": compute_name,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "load_s": load_s,
        "reload_s": reload_s,
        "samples": len(samples),
        "questions": questions,
        "k": k,
        "tokens": tokens,
        "prompt_tokens_mean": statistics.fmean(prompt_lens),
        "response_tokens_mean": statistics.fmean(resp_lens),
        "response_masked_frac": masked,
        "micro_batch_tokens": args.micro_batch_tokens,
        "micro_batch_tokens_capped": budget,
        "micro_batches": len(plan_micro_batches(lengths, budget)),
        "reps": reps_out,
        "median": med,
        "padding_waste": med["padding_waste"],
        "padding_waste_unsorted_single_batch": naive_waste,
        "rss_mb": {"start": rss_start, "model_loaded": rss_model, "after_warmup": rss_warm, "after_updates": rss_train},
        "peak_rss_mb": peak_rss_mb(),
        "phase_peak_rss_mb": rss.peaks,
        "checkpoint": {"size_mb": size / 2**20, "save_s": saves, "load_s": loads, "load_verified_s": loads_verified},
        "target": TARGET_RATIO,
        "met": med["ratio_total"] >= TARGET_RATIO,
        "met_without_scoring": med["ratio_without_scoring"] >= TARGET_RATIO,
        "met_with_scoring_pass": med["ratio_with_scoring_pass"] >= TARGET_RATIO,
    }


# ------------------------------------------------------------------------------------------------ whole step
STEP_TARGET_RATIO = 1.1
STEP_TARGET_RSS_MB = 6 * 1024


def bench_step(args_dict: dict[str, Any]) -> dict[str, Any]:
    """One single-turn RL step of SmolLM2 at default optim settings (the ``make demo`` model settings: float32
    master weights, bf16 autocast, the engine's own bf16 copy): HF-engine rollout of 8 questions × 4 samples
    (64 new tokens each, EOS off so both arms make the same tokens) + ``PolicyUpdater.update`` + the engine's
    weight refresh, against raw ``model.generate`` (same bf16 copy) + raw forward/backward of the same sequences
    in the same micro-batches, interleaved. Per-phase peak RSS; the step's peak is the target (< 6 GiB)."""
    args = argparse.Namespace(**args_dict)
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    cli_logging(quiet=True)
    from aepo_core.interfaces import GenerationRequest, SamplingParams
    from infra.engines.hf import HFEngine
    from infra.engines.weights import PolicyWeights

    questions, k, new_tokens = 8, 4, 64
    reps = args.reps or (1 if args.quick else 2)
    rss = PhaseRss()
    cfg = ExperimentConfig.model_validate({
        "model": {"name": BUILTIN_SMOLLM2, "dtype": "float32", "compute_dtype": args.compute or "auto",
                  "generation_dtype": {None: "auto", "bfloat16": "bfloat16", "float32": "same"}[args.compute],
                  "cache_dir": args.model_cache},
        "rollout": {"k": k, "max_response_tokens": new_tokens, "temperature": 1.0},
        "optim": {"lr": 1e-6, "mini_batch_size": questions},  # default micro_batch_tokens and memory budget
    })
    with rss("load"):
        model, tokenizer = load_policy(cfg.model)
        numerics = numerics_for(cfg)  # as a run on this CPU: a bf16 copy only where bf16 is fast
        copy_dtype = GENERATION_DTYPES.get(numerics.generation_dtype)  # None: "same", the training model
        generation_model = (model if copy_dtype is None
                            else copy.deepcopy(model).to(copy_dtype).eval().requires_grad_(False))
    compute = autocast_dtype(numerics.compute_dtype)
    engine = HFEngine(generation_model, tokenizer, seed=args.seed, stop_token_ids=(),  # EOS off: fixed length
                      autocast_dtype=compute if copy_dtype is None else None)
    backend = TimedBackend(TorchBackend(model, cfg.optim, total_steps=1000, compute_dtype=compute), rss)
    pad = int(tokenizer.pad_token_id)
    # The same update with every layer's activations kept (optim.activation_checkpointing off, its own micro-batch
    # cap), on the same samples and weights in the same run: what checkpointing costs and saves.
    kept_cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"activation_checkpointing": False})})
    kept_updater = PhasedUpdater(backend, kept_cfg, pad_id=pad)
    updater = PhasedUpdater(backend, cfg, pad_id=pad)  # constructed last: its setting is the model's
    task = SyntheticTask(n_companies=40)
    prompts = [chat_prompt_ids(tokenizer, row.question) for row in task.questions("train")[:questions]]
    requests = [GenerationRequest(prompt_ids=p, max_tokens=new_tokens, seed=args.seed + i)
                for i, p in enumerate(p for p in prompts for _ in range(k))]
    width = max(len(r.prompt_ids) for r in requests)
    input_ids = torch.full((len(requests), width), pad, dtype=torch.long)
    attention = torch.zeros((len(requests), width), dtype=torch.long)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        attention[i, width - len(r.prompt_ids):] = 1
    rng = random.Random(args.seed)

    def aepo_step(rep: int) -> tuple[float, float, list[TrainSample]]:
        t0 = time.perf_counter()
        with rss("step"):
            with rss("rollout"):
                results = engine.generate(requests, SamplingParams(temperature=1.0))
            t_rollout = time.perf_counter() - t0
            samples = [TrainSample(list(q.prompt_ids) + r.token_ids, len(q.prompt_ids), [1] * len(r.token_ids),
                                   r.logprobs, rng.gauss(0.0, 1.0), i // k, r.entropies)
                       for i, (q, r) in enumerate(zip(requests, results, strict=True))]
            with rss("update"):
                updater.update(samples)
            with rss("weight refresh"):
                engine.load_weights(PolicyWeights(model, rep + 1))
        return t_rollout, time.perf_counter() - t0, samples

    def kept_update(samples: Sequence[TrainSample]) -> float:
        checkpoint_decoder_layers(model, False)
        t0 = time.perf_counter()
        with rss("update, activations kept"):
            kept_updater.update(samples)
        checkpoint_decoder_layers(model, cfg.optim.activation_checkpointing)
        return time.perf_counter() - t0

    def raw_step(samples: Sequence[TrainSample]) -> tuple[float, float]:
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        with rss("raw step"), torch.inference_mode():
            out = generation_model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                            eos_token_id=None, pad_token_id=pad)
        t_generate = time.perf_counter() - t0
        assert out.shape[1] - width == new_tokens
        with rss("raw step"):
            raw_forward_backward(model, samples, pad, kept_updater.micro_batch_tokens, compute)
        return t_generate, time.perf_counter() - t0

    log.info("[step] warm-up")
    _, _, samples = aepo_step(-1)  # allocates AdamW state (a one-time cost), warms both paths
    raw_step(samples[:4])
    reps_out = []
    for rep in range(reps):
        got: dict[str, float] = {}
        for what in (("aepo", "kept", "raw") if rep % 2 == 0 else ("raw", "kept", "aepo")):
            if what == "aepo":
                got["rollout_s"], got["step_s"], samples = aepo_step(rep)
                got["update_s"] = got["step_s"] - got["rollout_s"]
            elif what == "kept":
                got["update_kept_s"] = kept_update(samples)
            else:
                got["raw_generate_s"], got["raw_step_s"] = raw_step(samples)
        got["ratio"] = got["step_s"] / got["raw_step_s"]
        reps_out.append(got)
        log.info("[step] rep %d: step %.1f s (rollout %.1f) vs raw %.1f s (generate %.1f): %.2f×", rep,
                 got["step_s"], got["rollout_s"], got["raw_step_s"], got["raw_generate_s"], got["ratio"])
    rss.close()
    med = {key: statistics.median(r[key] for r in reps_out) for key in reps_out[0]}
    tokens = sum(len(s.input_ids) for s in samples)
    step_peak = rss.peaks["step"]
    return {
        "model": BUILTIN_SMOLLM2, "numerics": numerics.params(), "questions": questions, "k": k,
        "new_tokens": new_tokens, "tokens": tokens,
        "micro_batch_tokens": cfg.optim.micro_batch_tokens, "micro_batch_tokens_capped": updater.micro_batch_tokens,
        "memory_budget_gb": cfg.optim.memory_budget_gb, "reps": reps_out, "median": med,
        "activation_checkpointing": cfg.optim.activation_checkpointing,
        "micro_batch_tokens_capped_kept": kept_updater.micro_batch_tokens,
        "update_tok_s": tokens / med["update_s"], "update_kept_tok_s": tokens / med["update_kept_s"],
        "phase_peak_rss_mb": rss.peaks, "step_peak_rss_mb": step_peak, "process_peak_rss_mb": peak_rss_mb(),
        "target_ratio": STEP_TARGET_RATIO, "met_ratio": med["ratio"] <= STEP_TARGET_RATIO,
        "target_rss_mb": STEP_TARGET_RSS_MB, "met_rss": step_peak < STEP_TARGET_RSS_MB,
    }


def report_step(step: dict[str, Any]) -> None:
    med, peaks = step["median"], step["phase_peak_rss_mb"]
    print_table(f"whole single-turn step ({step['questions']}×{step['k']}, {step['new_tokens']} new tokens, "
                f"{'/'.join(step['numerics'].values())}, "
                f"micro-batch {step['micro_batch_tokens_capped']} tokens): rollout + update vs raw generate + fwd/bwd",
                ["rollout s", "update s", "step s", "raw generate s", "raw step s", "ratio",
                 f"≤ {STEP_TARGET_RATIO}", "update tok/s", "peak RSS step MB", f"< {STEP_TARGET_RSS_MB}"],
                [[med["rollout_s"], med["update_s"], med["step_s"], med["raw_generate_s"], med["raw_step_s"],
                  med["ratio"], step["met_ratio"], step["update_tok_s"], step["step_peak_rss_mb"], step["met_rss"]]])
    print_table("the update with activation checkpointing vs every layer's activations kept (same samples, same run)",
                ["checkpointed", "micro-batch", "update s", "update tok/s", "peak RSS MB",
                 "kept: micro-batch", "update s", "update tok/s", "peak RSS MB"],
                [[step["activation_checkpointing"], step["micro_batch_tokens_capped"], med["update_s"],
                  step["update_tok_s"], peaks["update"], step["micro_batch_tokens_capped_kept"],
                  med["update_kept_s"], step["update_kept_tok_s"], peaks["update, activations kept"]]])
    print_table("peak RSS per phase (MB)", list(peaks), [[peaks[k] for k in peaks]])


# -------------------------------------------------------------------------------------------------------- main
def report(results: dict[str, Any]) -> None:
    threads = results["environment"]["torch_threads"]
    rows, rows2 = [], []
    for m in results["models"]:
        med = m["median"]
        rows.append([m["model"], f"{m['weights_dtype']}/{m['compute_dtype']}", m["samples"], m["tokens"],
                     f"{m['prompt_tokens_mean']:.0f}+{m['response_tokens_mean']:.0f}", med["raw_tok_s"],
                     med["update_tok_s"], med["ratio_total"], med["ratio_with_scoring_pass"],
                     med["ratio_fwd_bwd_only"], f"{med['scored_scoring_s']:.1f}/{med['scored_update_s']:.1f}",
                     len(m["reps"]), m["met"]])
        c = m["checkpoint"]
        rows2.append([m["model"], f"{m['load_s']:.1f}/{m.get('reload_s', math.nan):.2f}",
                      f"{m['padding_waste'] * 100:.1f}%",
                      f"{m['padding_waste_unsorted_single_batch'] * 100:.1f}%", m["peak_rss_mb"],
                      m["rss_mb"]["model_loaded"], m["phase_peak_rss_mb"]["raw fwd+bwd"],
                      m["phase_peak_rss_mb"]["update"],
                      c["size_mb"], min(c["save_s"]), min(c["load_s"]), min(c["load_verified_s"])])
    print_table(f"trainer tokens/s: PolicyUpdater.update vs raw HF forward+backward — torch threads {threads}",
                ["model", "weights/compute", "samples", "tokens", "prompt+resp", "raw tok/s", "update tok/s",
                 "ratio (on-policy)", "ratio w/ scoring pass", "ratio fwd+bwd only", "scoring/update s (off-pol.)",
                 "reps",
                 f"≥ {TARGET_RATIO}"], rows)
    for m in results["models"]:
        peaks = m["phase_peak_rss_mb"]
        print_table(f"{m['model']}: peak RSS per phase (MB), micro-batch {m['micro_batch_tokens_capped']} tokens",
                    list(peaks), [[peaks[k] for k in peaks]])
    print_table("padding, memory, checkpoints",
                ["model", "load s first/again", "padding waste", "unsorted 1-batch", "peak RSS MB", "RSS after load MB",
                 "peak RSS raw MB", "peak RSS update MB", "ckpt MB", "save s", "load s", "load+verify s"], rows2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--quick", action="store_true", help="smaller batches, one repetition (~1–2 min)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on 2 shared cores, 2 threads thrash under load)")
    p.add_argument("--compute", choices=["float32", "bfloat16"], default=None,
                   help="autocast compute dtype (default: float32 for tiny-random, bfloat16 for SmolLM2)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=0, help="override the interleaved repetitions")
    p.add_argument("--model-cache", default=os.environ.get("AEPO_MODEL_CACHE"),
                   help="converted-model cache (default $AEPO_MODEL_CACHE, else ~/.cache/aepo/models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", action=argparse.BooleanOptionalAction, default=True,
                   help="the whole single-turn step (rollout + update) of SmolLM2 vs raw generate + fwd/bwd")
    p.add_argument("--only-step", action="store_true", help="the whole step only (no per-model arms)")
    p.add_argument("--in-process", action="store_true", help="no subprocess per model (peak RSS accumulates)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/train_step[-quick].json)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local (converted cache); never reach the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cli_logging()
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "train_step",
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": environment(args.threads),
        "models": [],
    }
    names = () if args.only_step else MODELS if args.model == "both" else (args.model,)
    args_dict = {k: v for k, v in vars(args).items() if k != "out"}
    for name in names:
        if args.in_process:
            results["models"].append(bench_model(name, args_dict))
            continue
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results["models"].append(pool.submit(bench_model, name, args_dict).result())
    if args.step and (args.model in ("both", BUILTIN_SMOLLM2)):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results["step"] = pool.submit(bench_step, args_dict).result()
    results["environment"]["load_avg_end"] = list(os.getloadavg())
    results["total_s"] = time.perf_counter() - started
    results["targets"] = {f"trainer_ratio[{m['model']}]": m["met"] for m in results["models"]}
    if "step" in results:
        results["targets"].update({"step_ratio": results["step"]["met_ratio"], "step_rss": results["step"]["met_rss"]})
    stem = "train_step-step" if args.only_step else "train_step"
    out = args.out or RESULTS_DIR / (f"{stem}-quick.json" if args.quick else f"{stem}.json")
    write_result(out, results)
    if results["models"]:
        report(results)
    if "step" in results:
        report_step(results["step"])
    print(closing_line(results, args.threads, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
