"""Cold-start SFT on multi-turn tool-use transcripts (the paper's stage before RL).

Transcripts use the rollout's token protocol: the prompt through the chat template once, then each segment
tokenized on its own (model text, or a ``<result>`` block), so SFT sees the token boundaries RL will see.
The loss is token-mean cross-entropy over model tokens only; tool results condition but never get gradient.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aepo_core.config import SFTConfig
from infra.data.rows import QuestionRow
from infra.data.synthetic import oracle_transcript
from infra.engines.weights import PolicyWeights
from infra.numerics import autocast_dtype
from infra.run.runtime import PolicyRuntime
from infra.training.backend import TrainBackend
from infra.training.backends import TorchBackend
from infra.training.batching import TrainSample, collate, plan_micro_batches
from infra.training.logprobs import response_logprobs_and_entropy
from infra.training.memory import checkpoint_decoder_layers, micro_batch_token_cap, release_memory

log = logging.getLogger(__name__)

Segments = Sequence[tuple[str, str]]  # ("model" | "tool", text)


def sft_sample(prompt_ids: Sequence[int], segments: Segments, encode: Callable[[str], list[int]]) -> TrainSample:
    ids: list[int] = []
    mask: list[int] = []
    for kind, text in segments:
        if kind not in ("model", "tool"):
            raise ValueError(f"segment kind must be 'model' or 'tool', got {kind!r}")
        seg = encode(text)
        ids += seg
        mask += [1 if kind == "model" else 0] * len(seg)
    return TrainSample(list(prompt_ids) + ids, len(prompt_ids), mask, [0.0] * len(ids), 0.0, 0)


def _nll_sum(backend: TrainBackend, samples: Sequence[TrainSample], pad_id: int, token_budget: int,
             device: torch.device, norm: float, with_grad: bool) -> float:
    total = 0.0
    lengths = [len(s.input_ids) for s in samples]
    for mb in plan_micro_batches(lengths, token_budget):
        batch = collate([samples[i] for i in mb], pad_id, device)
        logprobs, _ = response_logprobs_and_entropy(backend, batch, 1.0, with_grad=with_grad, with_entropy=False)
        loss = -(logprobs * batch.loss_mask).sum() / norm
        if with_grad:
            backend.backward(loss)
        total += float(loss.detach())
    return total


def sft_loss(backend: TrainBackend, samples: Sequence[TrainSample], pad_id: int, token_budget: int) -> float:
    """Token-mean NLL over model tokens (no gradient)."""
    device = backend.device
    norm = float(sum(sum(s.loss_mask) for s in samples)) or 1.0
    backend.module.eval()
    with torch.no_grad():
        return _nll_sum(backend, samples, pad_id, token_budget, device, norm, with_grad=False)


def train_sft(backend: TrainBackend, samples: Sequence[TrainSample], cfg: SFTConfig, pad_id: int, token_budget: int,
            seed: int, on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """``cfg.epochs`` passes over the samples in seeded shuffled batches; one optimizer step per batch."""
    if cfg.max_examples is not None:
        samples = list(samples)[: cfg.max_examples]
    device = backend.device
    rng = random.Random(seed)
    history = []
    step = 0
    for epoch in range(cfg.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), cfg.batch_size):
            batch = [samples[i] for i in order[start : start + cfg.batch_size]]
            norm = float(sum(sum(s.loss_mask) for s in batch)) or 1.0
            t0 = time.perf_counter()
            backend.module.train()
            loss = _nll_sum(backend, batch, pad_id, token_budget, device, norm, with_grad=True)
            grad_norm = backend.step()
            backend.module.eval()
            step += 1
            tokens = sum(len(s.input_ids) for s in batch)
            metrics = {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/epoch": float(epoch),
                       "sft/tokens_per_s": tokens / max(1e-9, time.perf_counter() - t0), "sft/lr": backend.current_lr()}
            history.append(metrics)
            if on_step is not None:
                on_step(step, metrics)
    log.info("SFT: %d steps over %d examples, last loss %.4f", step, len(samples),
             history[-1]["sft/loss"] if history else float("nan"))
    return history


@dataclass(frozen=True)
class SFTReport:
    """What cold-start SFT did: the loss of its first and last batch as they were trained on, optimizer steps,
    transcripts, and mean training throughput (tokens/s)."""

    loss_first_batch: float
    loss_last_batch: float
    steps: int
    examples: int
    tokens_per_s: float

    def metrics(self) -> dict[str, float]:
        """``sft/…``: the names under which MLflow records this report."""
        return {"sft/loss_first_batch": self.loss_first_batch, "sft/loss_last_batch": self.loss_last_batch,
                "sft/steps": float(self.steps), "sft/examples": float(self.examples),
                "sft/tokens_per_s": self.tokens_per_s}


def run_sft(runtime: PolicyRuntime, rows: Sequence[QuestionRow]) -> SFTReport:
    """Cold-start SFT of the runtime's policy on oracle transcripts of synthetic ``rows`` (the real tools produce
    the results), with its own optimizer (``train.sft``); the engine then samples from the new weights."""
    if runtime.task is None:
        raise ValueError("cold-start SFT needs oracle transcripts: use data.train=synthetic")
    cfg = runtime.cfg
    sft_cfg = cfg.train.sft
    search, python = runtime.tools.get("search"), runtime.tools.get("python")
    if search is None or python is None:
        raise ValueError("cold-start SFT transcripts need both the search and the python tool")
    rows = list(rows)[: sft_cfg.max_examples] if sft_cfg.max_examples else list(rows)
    samples = []
    for row in rows:
        segments = oracle_transcript(row, lambda q: search(q).text, lambda c: python(c).text,
                                     max_result_chars=cfg.rollout.max_result_chars, varied=sft_cfg.varied)
        samples.append(sft_sample(runtime.prompt_ids(row.question), segments, runtime.encode))
    steps = sft_cfg.epochs * -(-len(samples) // sft_cfg.batch_size)
    backend = TorchBackend(runtime.model, sft_cfg.optimizer(cfg.optim), steps,
                           compute_dtype=autocast_dtype(runtime.numerics.compute_dtype))
    # Loss of the first and the last batch as they were trained on (a separate before/after pass over all
    # transcripts would cost two more forward passes: a third of the SFT time on CPU).
    token_budget = micro_batch_token_cap(cfg.optim, runtime.model, backend.device)
    checkpoint_decoder_layers(runtime.model, cfg.optim.activation_checkpointing)
    history = train_sft(backend, samples, sft_cfg, runtime.pad_id, token_budget,
                        seed=sft_cfg.order_seed(cfg.seed))
    del backend  # SFT's own AdamW moments (2 × the weights) are not the RL optimizer's
    release_memory()  # its activations' and moments' heap pages back to the OS before evaluation and RL
    runtime.weights_changed(PolicyWeights(runtime.model, 0))
    return SFTReport(history[0]["sft/loss"], history[-1]["sft/loss"], len(history), len(samples),
                     sum(h["sft/tokens_per_s"] for h in history) / len(history))
