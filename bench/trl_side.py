"""TRL's side of ``bench/trl_step.py``: GRPO steps of ``trl.GRPOTrainer`` on the workload that script wrote.

Runs in TRL's own virtualenv (``make trl``: ``.venv-trl``), so it imports only the standard library at module level
and trl / transformers / datasets / torch inside :func:`main`, never this repository's package: ``bench.trl_step``
imports :func:`answer_reward` from here, so both sides score with the very same function.

Usage (``bench.trl_step`` runs it): ``.venv-trl/bin/python bench/trl_side.py --workload W.json --out R.json``.
The workload names the converted model directory, the prompts (chat-template text and the token ids ours samples
from, checked equal here), the gold answers and the settings (k, new tokens, lr, clipping, threads, ...). The
result: the wall time of every optimizer step (the first is the warm-up), the part of it in TRL's generation and
scoring (``_generate_and_score_completions``), TRL's logged metrics per step and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


def _normalized(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed."""
    kept = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text.lower())
    return " ".join(kept.split())


def answer_reward(text: str, golds: Sequence[str]) -> float:
    """The benchmark's reward, the same function on both sides: 1.0 when the answer (the ``\\boxed{}`` content of the
    last ``<answer>…</answer>`` block, else that block's text) equals a gold answer up to case, punctuation and
    whitespace; 0.1 for a non-empty answer block that does not; 0.0 without one. Length-free: no length term."""
    blocks = _ANSWER_RE.findall(text)
    if not blocks:
        return 0.0
    boxed = _BOXED_RE.findall(blocks[-1])
    answer = _normalized(boxed[-1] if boxed else blocks[-1])
    if not answer:
        return 0.0
    return 1.0 if any(answer == _normalized(g) for g in golds) else 0.1


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Path, required=True, help="the JSON bench.trl_step wrote")
    p.add_argument("--out", type=Path, required=True, help="where this side's result JSON goes")
    args = p.parse_args(argv)
    w: dict[str, Any] = json.loads(args.workload.read_text())
    started = time.perf_counter()

    import torch

    torch.set_num_threads(w["threads"])
    torch.set_num_interop_threads(w["threads"])
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    tokenizer = AutoTokenizer.from_pretrained(w["model_dir"])
    for text, ids in zip(w["prompt_texts"], w["prompt_ids"], strict=True):
        # TRL tokenizes a plain-text prompt with the tokenizer's call: it must give the ids ours samples from
        if tokenizer(text=[text])["input_ids"][0] != ids:
            raise SystemExit("trl_side: TRL's tokenization of a prompt differs from ours; the workloads would differ")
    model = AutoModelForCausalLM.from_pretrained(w["model_dir"], dtype=torch.float32)
    load_s = time.perf_counter() - started

    def reward(prompts: list[str], completions: list[str], golds: list[list[str]], **_: Any) -> list[float]:
        return [answer_reward(c, g) for c, g in zip(completions, golds, strict=True)]

    rows = w["questions"] * w["k"]
    per_device = w["trl_micro_batch"] or rows
    if rows % per_device:
        raise SystemExit(f"trl_side: {rows} completions do not split into micro-batches of {per_device}")
    config = trl.GRPOConfig(
        output_dir=str(args.out.parent / "trl-output"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, seed=w["seed"], data_seed=w["seed"],
        max_steps=w["warmup_steps"] + w["steps"],
        # one optimizer step per generation batch of questions × k completions, in rows / per_device micro-batches
        per_device_train_batch_size=per_device, gradient_accumulation_steps=rows // per_device,
        num_generations=w["k"], max_completion_length=w["new_tokens"],
        temperature=w["temperature"], top_p=w["top_p"], top_k=w["top_k"],
        beta=0.0, num_iterations=1, epsilon=w["clip_low"], epsilon_high=w["clip_high"], delta=w["dual_clip"],
        loss_type=w["trl_loss_type"], scale_rewards="group",
        learning_rate=w["lr"], lr_scheduler_type=w["lr_schedule"], warmup_steps=0, weight_decay=w["weight_decay"],
        adam_beta1=w["betas"][0], adam_beta2=w["betas"][1], adam_epsilon=w["eps"], max_grad_norm=w["grad_clip"],
        optim="adamw_torch",  # ours: torch.optim.AdamW, not the fused kernel transformers picks by default
        gradient_checkpointing=w["activation_checkpointing"],
        dataloader_num_workers=0,
    )
    dataset = datasets.Dataset.from_list([{"prompt": t, "golds": list(g)}
                                          for t, g in zip(w["prompt_texts"], w["golds"], strict=True)])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer)

    steps: list[dict[str, float]] = []
    generate_s: list[float] = []
    completion_tokens: list[int] = []
    inner = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **kw: Any) -> Any:  # TRL's rollout: generate, decode, reward, advantages
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        generate_s.append(time.perf_counter() - t0)
        completion_tokens.append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append({"step_s": time.perf_counter() - self.t0, "peak_rss_mb": _peak_rss_mb()})

    trainer.add_callback(StepTimer())
    trainer.train()
    if len(generate_s) != len(steps):
        raise SystemExit(f"trl_side: {len(generate_s)} generations for {len(steps)} optimizer steps")
    logged = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    for s, gen, toks, log in zip(steps, generate_s, completion_tokens, logged, strict=False):
        s.update({"rollout_s": gen, "update_s": s["step_s"] - gen, "completion_tokens": toks,
                  "reward_mean": log.get("reward"), "completion_mean_length": log.get("completions/mean_length"),
                  "loss": log.get("loss"), "grad_norm": log.get("grad_norm"), "entropy": log.get("entropy")})
    result = {
        "side": "trl", "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
        "python": sys.version.split()[0], "torch_threads": torch.get_num_threads(),
        "gradient_checkpointing": config.gradient_checkpointing, "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": config.gradient_accumulation_steps, "loss_type": config.loss_type,
        "optim": str(config.optim), "load_s": load_s, "steps": steps, "peak_rss_mb": _peak_rss_mb(),
        "total_s": time.perf_counter() - started,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
