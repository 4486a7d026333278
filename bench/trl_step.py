"""One GRPO RL step of ours beside one of TRL's ``GRPOTrainer`` (issue 52, item 5): same model, prompts and reward.

The workload: SmolLM2-135M-Instruct in float32 on CPU (both sides load the same converted HF directory of the
model cache), 8 synthetic-task questions × k = 4 samples, at most 64 new tokens, temperature 1, top-p 1, no top-k,
no tools, no KL, one optimizer step per RL step at the same AdamW settings, and the same reward function
(:func:`bench.trl_side.answer_reward`: exact match of the boxed answer, 0.1 for a wrong answer block, length-free).
Each side runs in its own process, so that its peak RSS is its own: ours through the real code path
(:func:`infra.run.runtime.build_runtime` + :class:`infra.run.trainer.Trainer`, the train flow's :func:`rl_step`
without Prefect, the trajectory store and MLflow: sample → score → informative batch → update → weights to the
engine), ``rollout.mode: independent``, ``algorithm.loss: ppo_clip``, no entropy-aware advantage; TRL's in its own
virtualenv (``make trl``) by ``bench/trl_side.py``. Both sides take the same torch thread count (``--threads``:
``torch.set_num_threads``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``), run a warm-up step, then ``--steps`` timed
ones; reported: step, rollout and update wall time, completion tokens, reward, each side's peak RSS and the ratio
ours / TRL of the step time. What could not be matched: :data:`DIFFERENCES`.

Run: ``.venv/bin/python -m bench.trl_step [--threads 2] [--ours-set model.sampler_dtype=int8 ...]``.
Writes ``bench/results/trl_step.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.interfaces import RewardResult
from aepo_core.overrides import build_config
from bench.harness import (
    REPO,
    RESULTS_DIR,
    cli_logging,
    closing_line,
    environment,
    machine_label,
    print_table,
    write_result,
)
from bench.trl_side import answer_reward

log = logging.getLogger("bench.trl_step")

QUESTIONS, K, NEW_TOKENS = 8, 4, 64
TRL_SIDE = Path(__file__).with_name("trl_side.py")
DEFAULT_TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"

BASE: dict[str, Any] = {
    "name": "trl-step",
    "seed": 0,
    # float32 throughout: master weights, compute, and sampling on the training weights (no bf16 or int8 copy)
    "model": {"name": "smollm2-135m-instruct", "dtype": "float32", "compute_dtype": "float32",
              "generation_dtype": "same", "sampler_dtype": "generation"},
    # independent sampling of k per question, no tools (the search and python tools off: an empty tools dict;
    # max_tool_calls 0: a tool call the model writes gets the limit notice, the next one ends the path)
    "rollout": {"mode": "independent", "k": K, "max_response_tokens": NEW_TOKENS, "temperature": 1.0, "top_p": 1.0,
                "top_k": 0, "max_tool_calls": 0},
    "tools": {"search": {"enabled": False}, "python": {"enabled": False}},
    "algorithm": {"loss": "ppo_clip", "entropy_advantage": False, "kl_coef": 0.0, "advantage": "grpo",
                  "loss_agg": "token-mean"},
    "optim": {"lr": 1e-6, "ppo_epochs": 1, "mini_batch_size": QUESTIONS},  # one mini-batch: one optimizer step
    "train": {"batch_size": QUESTIONS},
    "data": {"train": "synthetic", "max_questions": QUESTIONS},
    "reward": {"kind": "em"},  # replaced by answer_reward (the same function as TRL's side) once the runtime is built
}

TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
"""Our ``algorithm.loss_agg`` → TRL's ``loss_type`` of the same normalisation (TRL's ``dapo``: Σ token losses over
the number of completion tokens in the whole accumulated batch, as our token-mean over the mini-batch)."""

DIFFERENCES = (
    "rollout stops: ours ends a segment at the protocol's closing tags (</search>, </python>, </answer>) as well as "
    "at EOS; with tools off a tool call gets a notice block (masked out of the loss) and max_tool_calls 0 ends the "
    "path at the next call, so ours can end earlier or spend budget on notice tokens; TRL samples each completion "
    "in one generate call to EOS or max_completion_length. Completion tokens differ: compare the tokens columns",
    "sampler: ours is its own engine (HFEngine: batched KV-cached decode, per-token entropies kept); TRL calls "
    "transformers' model.generate",
    "update batching: ours packs length-sorted micro-batches under a token budget (optim.micro_batch_tokens, capped "
    "by optim.memory_budget_gb) over prompt + response; TRL runs per_device_train_batch_size rows at a time "
    "(--trl-micro-batch, default all 32: one padded batch), prompts left-padded and completions right-padded to "
    "the batch's longest",
    "log-probs: ours projects the response positions onto the vocabulary chunk by chunk (infra.training.logprobs); "
    "TRL computes the logits of the completion positions at once (logits_to_keep) and their entropy for its logs",
    "advantages: both (r - group mean) / (unbiased group std + eps), eps 1e-6 ours, 1e-4 TRL",
    "clipping: ours ppo_clip with dual-clip c = 3; TRL epsilon 0.2 with delta = 3 (the same bound); on-policy with "
    "one mini-batch every ratio is 1 on both sides, so neither clips",
    "bookkeeping: TRL's step includes the HF Trainer/accelerate machinery and its metric logging; ours leaves out "
    "the train flow's Prefect tasks, trajectory store and MLflow logging (bench/train_step.py times a step likewise)",
)


# ------------------------------------------------------------------------------------------------ the workload
def our_config(overrides: Sequence[str] = (), model_cache: str | None = None) -> ExperimentConfig:
    """The config of our side: :data:`BASE`, ``model.cache_dir``, then the ``--ours-set`` overrides (a bad key or
    value raises :class:`~aepo_core.config_keys.ConfigError`)."""
    cache = [f"model.cache_dir={model_cache}"] if model_cache else []
    return build_config(BASE, [*cache, *overrides], source="bench.trl_step")


def build_workload(cfg: ExperimentConfig, args: argparse.Namespace) -> dict[str, Any]:
    """What both sides run: the converted model directory, the questions' prompts (chat-template text and token
    ids, as our runtime builds them) and golds, and the settings TRL's side is configured with (from ``cfg``)."""
    from infra.data.loaders import load_dataset_rows
    from infra.data.synthetic import SyntheticTask
    from infra.models import chat_prompt_ids, chat_prompt_text, load_tokenizer, resolve_model_dir
    from infra.run.trainer import training_rows

    d, alg, optim, ro = cfg.data, cfg.algorithm, cfg.optim, cfg.rollout
    rows = training_rows(cfg, load_dataset_rows(d.train, d.on_bad_row, data_root=d.data_root,
                                                synthetic=SyntheticTask.from_config(d)))
    tokenizer = load_tokenizer(cfg.model)
    if alg.loss_agg not in TRL_LOSS_TYPE:
        raise ConfigError(f"algorithm.loss_agg={alg.loss_agg} has no TRL loss_type of the same normalisation")
    return {
        "model_dir": str(resolve_model_dir(cfg.model)), "seed": cfg.seed, "threads": args.threads,
        "warmup_steps": 1, "steps": args.steps, "questions": len(rows), "k": ro.k, "new_tokens": ro.max_response_tokens,
        "temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k,
        "lr": optim.lr, "lr_schedule": optim.lr_schedule, "weight_decay": optim.weight_decay,
        "betas": list(optim.betas), "eps": optim.eps, "grad_clip": optim.grad_clip,
        "activation_checkpointing": optim.activation_checkpointing,
        "clip_low": alg.clip_low, "clip_high": alg.clip_high, "dual_clip": alg.dual_clip,
        "trl_loss_type": TRL_LOSS_TYPE[alg.loss_agg], "trl_micro_batch": args.trl_micro_batch,
        "question_ids": [r.id for r in rows], "golds": [list(r.golds) for r in rows],
        "prompt_texts": [chat_prompt_text(tokenizer, r.question) for r in rows],
        "prompt_ids": [chat_prompt_ids(tokenizer, r.question) for r in rows],
    }


def shared_reward(response_text: str, golds: Sequence[str], tool_names: Sequence[str] = (), *,
                  model_text: str | None = None) -> RewardResult:
    """:func:`bench.trl_side.answer_reward` as our :class:`~aepo_core.interfaces.RewardFn`, on what the model wrote
    (TRL's completions hold nothing else)."""
    score = answer_reward(model_text if model_text is not None else response_text, golds)
    return RewardResult(score, "correct" if score >= 1.0 else "wrong" if score > 0 else "no_answer",
                        {"em": float(score >= 1.0)})


# ------------------------------------------------------------------------------------------------------ ours
def our_side(overrides: Sequence[str], model_cache: str | None, workload: dict[str, Any]) -> dict[str, Any]:
    """Our RL steps in this (fresh) process: a warm-up step, then the timed ones; peak RSS of the process."""
    started = time.perf_counter()
    from bench.harness import set_threads

    set_threads(workload["threads"])
    warnings.filterwarnings("ignore")
    cli_logging(quiet=True)
    from aepo_core.dynamic_sampling import InformativeBatch
    from aepo_core.rollout.scheduler import derive_seed
    from infra.run.runtime import build_runtime
    from infra.run.trainer import Trainer

    cfg = our_config(overrides, model_cache)
    with tempfile.TemporaryDirectory(prefix="trl-step-") as tmp, build_runtime(cfg, tmp) as runtime:
        runtime.reward_fn = shared_reward
        rows = runtime.load_rows(cfg.data.train)
        trainer = Trainer(runtime, rows, checkpoint_dir=Path(tmp) / "checkpoints", run_id="trl-step")
        by_id = {r.id: r for r in trainer.rows}
        if [runtime.prompt_ids(by_id[q].question) for q in workload["question_ids"]] != workload["prompt_ids"]:
            raise RuntimeError("our runtime's prompts differ from the workload's")
        load_s = time.perf_counter() - started

        def step(n: int) -> dict[str, float]:  # flows.train.rl_step without Prefect, the store and MLflow
            t0 = time.perf_counter()
            batch = InformativeBatch(cfg.train.batch_size, cfg.algorithm)
            while batch.wants_more():
                batch_rows = trainer.next_batch()
                parts = (cfg.seed, "rollout", n) + ((batch.tries,) if batch.tries else ())
                result = runtime.sample(batch_rows, cfg.rollout, derive_seed(*parts))
                batch.add(result, runtime.score(result, batch_rows))
            filled = batch.filled()
            t1 = time.perf_counter()
            metrics = trainer.update(filled.trees, filled.scores.leaves)
            t2 = time.perf_counter()
            tokens = sum(sum(t.loss_mask(leaf)) for t in filled.trees for leaf in t.leaves)
            leaves = sum(len(t.leaves) for t in filled.trees)
            return {"step_s": t2 - t0, "rollout_s": t1 - t0, "update_s": t2 - t1, "completion_tokens": tokens,
                    "completion_mean_length": tokens / max(1, leaves),
                    "tokens_generated": sum(r.stats.get("tokens_generated", 0.0) for r in filled.rollouts),
                    "reward_mean": filled.scores.metrics["rollout/reward_mean"],
                    "loss": metrics.get("train/loss"), "grad_norm": metrics.get("train/grad_norm"),
                    "micro_batch_tokens": metrics.get("train/micro_batch_tokens"),
                    "padding_waste": metrics.get("train/padding_waste"),
                    "scoring_pass": metrics.get("train/scoring_pass"),
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

        steps = []
        for n in range(1, 2 + workload["steps"]):
            steps.append(step(n))
            log.info("ours, step %d%s: %.1f s (rollout %.1f, update %.1f)", n, " (warm-up)" if n == 1 else "",
                     steps[-1]["step_s"], steps[-1]["rollout_s"], steps[-1]["update_s"])
        import torch

        return {"side": "ours", "numerics": runtime.numerics.params(), "config": cfg.model_dump(mode="json"),
                "overrides": list(overrides), "activation_checkpointing": cfg.optim.activation_checkpointing,
                "torch_threads": torch.get_num_threads(), "load_s": load_s, "steps": steps,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "total_s": time.perf_counter() - started}


# ------------------------------------------------------------------------------------------------------- TRL
def trl_side(python: Path, workload: dict[str, Any], workdir: Path, timeout_s: float | None) -> dict[str, Any]:
    """TRL's steps in its own interpreter (``bench/trl_side.py``); its stdout/stderr pass through."""
    wpath, out = workdir / "workload.json", workdir / "trl.json"
    wpath.write_text(json.dumps(workload))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this repository on its path
    subprocess.run([str(python), str(TRL_SIDE), "--workload", str(wpath), "--out", str(out)], env=env, check=True,
                   cwd=workdir, timeout=timeout_s, stdout=sys.stderr)
    return dict(json.loads(out.read_text()))


# ------------------------------------------------------------------------------------------------------ main
def timed(side: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps after the warm-up."""
    return list(side["steps"][1:])


def median_of(side: dict[str, Any], key: str) -> float:
    values = [s[key] for s in timed(side) if s.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, Any]) -> None:
    rows = []
    for name in ("ours", "trl"):
        side = results.get(name)
        if side is None:
            continue
        nums = side.get("numerics", {})
        label = (f"ours (compute {nums.get('numerics.compute_dtype')}, sampler {nums.get('numerics.sampler_dtype')})"
                 if name == "ours" else f"TRL {side['trl']}")
        rows.append([label, median_of(side, "step_s"), median_of(side, "rollout_s"), median_of(side, "update_s"),
                     median_of(side, "completion_tokens"), median_of(side, "reward_mean"),
                     side["steps"][0]["step_s"], side["peak_rss_mb"]])
    w = results["workload"]
    print_table(f"one RL step: {w['questions']} questions × {w['k']}, ≤ {w['new_tokens']} new tokens, float32 weights, "
                f"{w['threads']} torch threads, median of {w['steps']} step(s) after a warm-up — "
                f"{machine_label(results['environment'])}",
                ["side", "step s", "rollout s", "update s", "completion tokens", "reward", "warm-up step s",
                 "peak RSS MB"], rows)
    if "ratio_step" in results:
        print(f"ours / TRL: step {results['ratio_step']:.2f}×, rollout {results['ratio_rollout']:.2f}×, update "
              f"{results['ratio_update']:.2f}×, peak RSS {results['ratio_peak_rss']:.2f}×")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads of both sides (default 2)")
    p.add_argument("--questions", type=int, default=QUESTIONS, help=f"questions per step (default {QUESTIONS})")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                   help=f"most new tokens of a sample (default {NEW_TOKENS})")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step, each side (default 1)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override of our side's config, e.g. model.sampler_dtype=int8 (repeatable)")
    p.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON,
                   help="the interpreter of TRL's virtualenv (default .venv-trl/bin/python: `make trl`)")
    p.add_argument("--trl-micro-batch", type=int, default=0,
                   help="TRL's per_device_train_batch_size (0: all questions × k rows in one forward/backward)")
    p.add_argument("--sides", nargs="+", choices=["ours", "trl"], default=["ours", "trl"],
                   help="which sides run, in this order (default both, ours first)")
    p.add_argument("--model-cache", default=os.environ.get("AEPO_MODEL_CACHE"),
                   help="converted-model cache (default $AEPO_MODEL_CACHE, else ~/.cache/aepo/models)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds TRL's side may take")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "trl_step.json", help="JSON path")
    args = p.parse_args(argv)
    if min(args.threads, args.steps, args.questions, args.new_tokens) < 1 or args.trl_micro_batch < 0:
        p.error("--threads, --steps, --questions and --new-tokens must be ≥ 1, --trl-micro-batch ≥ 0")
    q = args.questions  # the sizes as overrides of our config (the workload, TRL's included, derives from it)
    args.overrides = [f"data.max_questions={q}", f"train.batch_size={q}", f"optim.mini_batch_size={q}",
                      f"rollout.max_response_tokens={args.new_tokens}", *args.ours_set]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # both sides' processes inherit them
        os.environ[var] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local (converted cache); never reach the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cli_logging()
    try:
        cfg = our_config(args.overrides, args.model_cache)
    except ConfigError as exc:
        print(f"bench.trl_step: {exc}", file=sys.stderr)
        return 2
    if "trl" in args.sides and not args.trl_python.is_file():
        print(f"bench.trl_step: no TRL interpreter at {args.trl_python} (`make trl`, or --trl-python)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    workload = build_workload(cfg, args)
    rows = workload["questions"] * workload["k"]
    if "trl" in args.sides and rows % (args.trl_micro_batch or rows):
        print(f"bench.trl_step: --trl-micro-batch must divide the {rows} completions of a step", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "benchmark": "trl_step", "args": {k: str(v) for k, v in vars(args).items()},
        "environment": environment(args.threads),
        "workload": {k: v for k, v in workload.items() if k not in ("prompt_texts", "prompt_ids", "golds")}
        | {"prompt_tokens_mean": statistics.mean(map(len, workload["prompt_ids"]))},
        "differences": list(DIFFERENCES),
    }
    with tempfile.TemporaryDirectory(prefix="trl-step-") as tmp:
        for side in args.sides:
            load = list(os.getloadavg())
            if side == "ours":
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    results["ours"] = pool.submit(our_side, args.overrides, args.model_cache, workload).result()
                results["environment"]["numerics"] = results["ours"]["numerics"]
            else:
                results["trl"] = trl_side(args.trl_python, workload, Path(tmp), args.timeout)
            results[side]["load_avg_start"] = load
    if "ours" in results and "trl" in results:
        for part in ("step", "rollout", "update"):
            results[f"ratio_{part}"] = median_of(results["ours"], f"{part}_s") / median_of(results["trl"], f"{part}_s")
        results["ratio_peak_rss"] = results["ours"]["peak_rss_mb"] / results["trl"]["peak_rss_mb"]
    results["environment"]["load_avg_end"] = list(os.getloadavg())
    results["total_s"] = time.perf_counter() - started
    write_result(args.out, results)
    report(results)
    print(closing_line(results, args.threads, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
