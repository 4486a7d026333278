"""One experiment's runtime: the heavy objects of a training run and the verbs the Prefect tasks call.

The model, tokenizer, engine, tools, trainer backend, data order, trajectory store and tracker live here,
built once per flow run; tasks receive the :class:`Experiment` and return small values (metrics, paths).
Every verb is deterministic given the config seed and the step, so a resumed run repeats nothing and skips
nothing: rollout seeds derive from (seed, step), the data order from (seed, epoch), and the checkpoint holds
the weights, optimizer, schedule, RNG states and data cursor.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aepo_core.config import ExperimentConfig
from aepo_core.evaluation import QuestionOutcome, is_correct, summarize, summarize_by
from aepo_core.interfaces import Engine, SamplingParams
from aepo_core.protocol import SYSTEM_PROMPT
from aepo_core.rewards import make_reward_fn, predicted_answer
from aepo_core.rollout.scheduler import Question, RolloutResult, RolloutScheduler, derive_seed
from aepo_core.scoring import NOTICE_EVENTS, ScoreSummary, score_trees
from infra.data.loaders import load_dataset_rows
from infra.data.rows import QuestionRow
from infra.data.synthetic import SyntheticTask, oracle_transcript
from infra.models import load_policy
from infra.store import TrajectoryStore
from infra.tools.registry import build_tools
from infra.training.backends import FrozenBackend, TorchBackend, autocast_dtype
from infra.training.batching import samples_from_trees
from infra.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from infra.training.data_order import DataCursor, DataOrder
from infra.training.sft import run_sft, sft_sample
from infra.training.update import PolicyUpdater

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def is_synthetic(spec: str) -> bool:
    return spec == SYNTHETIC or spec.startswith(SYNTHETIC + ":")


@dataclass
class EvalReport:
    dataset: str
    summary: dict[str, float]
    by_family: dict[str, dict[str, float]]
    outcomes: list[QuestionOutcome]
    per_question_pass1: dict[str, float] = field(default_factory=dict)
    answers: dict[str, list[str | None]] = field(default_factory=dict)  # per question: each sample's answer


class Experiment:
    """Everything one training/evaluation run holds; see the module docstring."""

    def __init__(self, cfg: ExperimentConfig, runs_dir: str | Path, run_name: str | None = None,
                 train_rows: Sequence[QuestionRow] | None = None) -> None:
        self.cfg = cfg
        self.runs_dir = Path(runs_dir)
        self.run_name = run_name or cfg.tracking.run_name or cfg.name
        self.checkpoint_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else (
            self.runs_dir / "checkpoints" / self.run_name)
        seed_everything(cfg.seed)
        self.task = SyntheticTask.from_config(cfg.data) if self._uses_synthetic() else None
        self.train_rows = list(train_rows) if train_rows is not None else self.load_rows(cfg.data.train)
        if cfg.data.max_questions is not None:
            self.train_rows = self.train_rows[: cfg.data.max_questions]
        if not self.train_rows:
            raise ValueError(f"data.train={cfg.data.train!r} has no usable rows")
        self.model, self.tokenizer = load_policy(cfg.model)
        self._generation_model: torch.nn.Module | None = None
        self.engine: Engine = self._build_engine()
        self.tools = build_tools(cfg.tools, self.runs_dir, documents=self.task.documents() if self.task else None)
        self.reward_fn = make_reward_fn(cfg.reward)
        self.order = DataOrder(len(self.train_rows), cfg.train.batch_size, cfg.seed, shuffle=cfg.data.shuffle)
        self.total_steps = cfg.train.steps or cfg.train.epochs * self.order.batches_per_epoch
        self.backend = self._build_backend()
        ref = (FrozenBackend(self._load_reference(), autocast_dtype(cfg.model.compute_dtype))
               if cfg.algorithm.kl_coef > 0 else None)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.updater = PolicyUpdater(self.backend, cfg, pad_id=int(pad), ref_backend=ref)
        self.cursor: DataCursor = self.order.start()
        self.step = 0
        self.run_id: str | None = None
        self.store = TrajectoryStore.from_config(cfg.storage) if cfg.storage.trajectories_uri else TrajectoryStore(
            self.runs_dir / "trajectories")
        self._prompt_cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ building
    def _uses_synthetic(self) -> bool:
        return is_synthetic(self.cfg.data.train) or any(is_synthetic(d) for d in self.cfg.eval.datasets) or (
            not self.cfg.eval.datasets and self.cfg.data.validation is None and is_synthetic(self.cfg.data.train))

    def load_rows(self, spec: str) -> list[QuestionRow]:
        return load_dataset_rows(spec, self.cfg.data.on_bad_row, data_root=self.cfg.data.data_root,
                                 synthetic=self.task)

    def _build_engine(self) -> Engine:
        r = self.cfg.rollout
        if r.engine == "remote":
            from infra.engines.remote import RemoteEngine

            if not r.remote_url:
                raise ValueError("rollout.engine=remote needs rollout.remote_url")
            return RemoteEngine(r.remote_url, r.remote_model or self.cfg.model.name, self.tokenizer,
                                reload_url=r.remote_reload_url)
        from infra.engines.hf import HFEngine

        gen_dtype = self.cfg.model.generation_dtype
        if gen_dtype == "same" or self.cfg.train.backend == "deepspeed":
            if gen_dtype != "same":
                log.warning("model.generation_dtype=%s ignored under DeepSpeed (partitioned weights): the engine "
                            "shares the training model", gen_dtype)
            return HFEngine(self.model, self.tokenizer, seed=self.cfg.seed,
                            autocast_dtype=autocast_dtype(self.cfg.model.compute_dtype))
        self._generation_model = copy.deepcopy(self.model).to(getattr(torch, gen_dtype)).eval()
        self._generation_model.requires_grad_(False)
        return HFEngine(self._generation_model, self.tokenizer, seed=self.cfg.seed)

    def weights_changed(self) -> None:
        """Refresh the engine's own weight copy, if it has one (after SFT, an update or a resume)."""
        gen = self._generation_model
        if gen is None:
            return
        with torch.no_grad():
            for dst, src in zip(gen.state_dict().values(), self.model.state_dict().values(), strict=True):
                dst.copy_(src)

    def _build_backend(self) -> Any:
        t = self.cfg.train
        if t.backend == "deepspeed":
            from infra.training.deepspeed_backend import DeepSpeedBackend

            return DeepSpeedBackend.from_config(self.model, self.cfg.optim, t, self.total_steps)
        return TorchBackend(self.model, self.cfg.optim, self.total_steps,
                            compute_dtype=autocast_dtype(self.cfg.model.compute_dtype))

    def _load_reference(self) -> torch.nn.Module:
        ref, _ = load_policy(self.cfg.model)
        return ref

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, question: str) -> list[int]:
        """The chat template is applied once per question; the transcript then only grows by token ids."""
        if question not in self._prompt_cache:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            self._prompt_cache[question] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._prompt_cache[question]

    # ------------------------------------------------------------------ RL step verbs
    def next_batch(self) -> list[QuestionRow]:
        """The rows of the current step; advances the data cursor."""
        indices, self.cursor = self.order.next_batch(self.cursor)
        return [self.train_rows[i] for i in indices]

    def rollout(self, rows: Sequence[QuestionRow], step: int) -> RolloutResult:
        scheduler = RolloutScheduler(self.engine, self.tools, self.cfg.rollout, tool_timeout_s=self.cfg.tools.timeout_s,
                                     tool_workers=self.cfg.tools.workers)
        questions = [Question(row.id, self.prompt_ids(row.question)) for row in rows]
        return scheduler.run(questions, seed=derive_seed(self.cfg.seed, "rollout", step))

    def score(self, result: RolloutResult, rows: Sequence[QuestionRow]) -> ScoreSummary:
        golds = {row.id: list(row.golds) for row in rows}
        return score_trees(result.trees, golds, self.reward_fn, self.cfg.algorithm,
                           self.cfg.rollout.max_response_tokens)

    def update(self, result: RolloutResult, summary: ScoreSummary) -> dict[str, float]:
        trees = [t for t in result.trees if t.question_id not in summary.uninformative_questions]
        metrics = self.updater.update(samples_from_trees(trees))
        self.step += 1
        self.weights_changed()
        sync = getattr(self.engine, "sync_weights", None)
        if sync is not None:  # a remote engine gets the new weights through its documented hook
            path = self.runs_dir / "weights" / self.run_name / f"step-{self.step:06d}"
            self.model.save_pretrained(path, state_dict=self.full_state_dict())
            self.tokenizer.save_pretrained(path)
            sync(str(path))
        return metrics

    def store_step(self, step: int, result: RolloutResult) -> list[str]:
        return self.store.write_step(self.run_id or self.run_name, step, result.trees)

    # ------------------------------------------------------------------ checkpoints
    def _optimizer_state(self) -> tuple[Any, Any]:
        """(optimizer-like, scheduler) for checkpoints: DeepSpeed keeps both in one training state."""
        if hasattr(self.backend, "training_state"):
            return self.backend.training_state, None
        return getattr(self.backend, "optimizer", None), getattr(self.backend, "scheduler", None)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gathered weights when the live parameters are ZeRO-3 partitions; None when the model holds them."""
        if getattr(self.backend, "zero_stage", 0) == 3:
            return self.backend.consolidated_state_dict()
        return None

    def save(self) -> Path:
        optimizer, scheduler = self._optimizer_state()
        return save_checkpoint(
            self.checkpoint_dir, self.step, model=self.model, tokenizer=self.tokenizer, config=self.cfg,
            optimizer=optimizer, scheduler=scheduler,
            data_cursor=self.cursor, run_id=self.run_id, extra={"order": self.order.state_dict()},
            keep=self.cfg.checkpoint.keep, state_dict=self.full_state_dict(),
        )

    def resume(self, force: bool = False) -> int | None:
        """Restore the newest complete checkpoint (falling back past corrupt ones); returns its step."""
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        optimizer, scheduler = self._optimizer_state()
        state = load_checkpoint(path, model=self.model, optimizer=optimizer, scheduler=scheduler, config=self.cfg,
                                force=force)
        saved_order = state.extra.get("order")
        if saved_order is not None:
            self.order.check_resumable(saved_order)
        self.step = state.step
        self.cursor = state.data_cursor or self.order.start()
        self.run_id = state.run_id
        self.weights_changed()
        log.info("resumed %s at step %d (data cursor %s)", path, self.step, self.cursor)
        return self.step

    # ------------------------------------------------------------------ evaluation
    def eval_datasets(self) -> list[str]:
        if self.cfg.eval.datasets:
            return list(self.cfg.eval.datasets)
        if self.cfg.data.validation:
            return [self.cfg.data.validation]
        return ["synthetic:test"] if self.task is not None else []

    def evaluate(self, spec: str, max_questions: int | None = None) -> EvalReport:
        """n samples per question at the evaluation temperature; unbiased Pass@1 / Pass@k with bootstrap CIs."""
        ev = self.cfg.eval
        rows = self.load_rows(spec)
        limit = max_questions or ev.max_questions
        rows = rows[:limit] if limit else rows
        rollout_cfg = replace_rollout(self.cfg, ev.n_samples)
        scheduler = RolloutScheduler(self.engine, self.tools, rollout_cfg, tool_timeout_s=self.cfg.tools.timeout_s,
                                     tool_workers=self.cfg.tools.workers)
        outcomes: list[QuestionOutcome] = []
        answers: dict[str, list[str | None]] = {}
        batch = ev.batch_size or self.cfg.train.batch_size
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            result = scheduler.run([Question(r.id, self.prompt_ids(r.question)) for r in chunk],
                                   seed=derive_seed(self.cfg.seed, "eval", spec, start),
                                   sampling=SamplingParams(ev.temperature, ev.top_p, 0))
            for row, tree in zip(chunk, result.trees, strict=True):
                outcomes.append(self._outcome(spec, row, tree))
                answers[row.id] = [predicted_answer(tree.text(leaf)) for leaf in tree.leaves]
        summary = summarize(outcomes, ev.pass_k, n_resamples=ev.bootstrap_samples, seed=self.cfg.seed)
        by_family = summarize_by(outcomes, "family", ev.pass_k, n_resamples=ev.bootstrap_samples, seed=self.cfg.seed)
        pass1 = {o.question_id: o.correct / o.n for o in outcomes}
        return EvalReport(spec, summary, by_family, outcomes, pass1, answers)

    def _outcome(self, spec: str, row: QuestionRow, tree: Any) -> QuestionOutcome:
        correct = em = f1 = calls = errors = answered = 0.0
        n_calls = 0
        for leaf in tree.leaves:
            events = [e for e in tree.tool_events(leaf) if e.name not in NOTICE_EVENTS]
            res = self.reward_fn(tree.text(leaf), list(row.golds), [e.name for e in events])
            correct += is_correct(res)
            em += res.details.get("em", float(is_correct(res)))
            f1 += res.details.get("f1", float(is_correct(res)))
            calls += len(events)
            n_calls += len(events)
            errors += sum(1 for e in events if not e.ok)
            answered += leaf.status == "answered"
        n = len(tree.leaves)
        return QuestionOutcome(row.id, spec, row.family, n, int(correct), em / n, f1 / n, calls / n,
                               errors / n_calls if n_calls else 0.0, answered / n)

    # ------------------------------------------------------------------ cold-start SFT
    def sft(self) -> dict[str, float]:
        """Cold-start SFT on oracle transcripts of the synthetic training split (real tools produce results)."""
        if self.task is None:
            raise ValueError("cold-start SFT needs oracle transcripts: use data.train=synthetic")
        sft_cfg = self.cfg.train.sft
        search, python = self.tools.get("search"), self.tools.get("python")
        if search is None or python is None:
            raise ValueError("cold-start SFT transcripts need both the search and the python tool")
        rows = self.train_rows[: sft_cfg.max_examples] if sft_cfg.max_examples else self.train_rows
        samples = []
        for row in rows:
            segments = oracle_transcript(row, lambda q: search(q).text, lambda c: python(c).text,
                                         max_result_chars=self.cfg.rollout.max_result_chars)
            samples.append(sft_sample(self.prompt_ids(row.question), segments,
                                      lambda t: list(self.tokenizer(t, add_special_tokens=False)["input_ids"])))
        pad = int(self.tokenizer.pad_token_id or 0)
        budget = self.cfg.optim.micro_batch_tokens
        steps = sft_cfg.epochs * -(-len(samples) // sft_cfg.batch_size)
        backend = TorchBackend(self.model, self.cfg.optim, steps, lr=sft_cfg.lr,
                               compute_dtype=autocast_dtype(self.cfg.model.compute_dtype))
        # Loss of the first and the last batch as they were trained on (a separate before/after pass over all
        # transcripts would cost two more forward passes: a third of the SFT time on CPU).
        history = run_sft(backend, samples, sft_cfg, pad, budget, seed=self.cfg.seed)
        self.weights_changed()
        return {"sft/loss_first_batch": history[0]["sft/loss"], "sft/loss_last_batch": history[-1]["sft/loss"],
                "sft/steps": float(len(history)), "sft/examples": float(len(samples)),
                "sft/tokens_per_s": sum(h["sft/tokens_per_s"] for h in history) / len(history)}


def replace_rollout(cfg: ExperimentConfig, n_samples: int) -> Any:
    """The rollout config of evaluation: n independent samples per question at the evaluation sampling."""
    return cfg.rollout.model_copy(update={"mode": "independent", "k": n_samples,
                                          "initial_rollouts": min(cfg.rollout.initial_rollouts, n_samples),
                                          "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p})


__all__ = ["EvalReport", "Experiment", "is_synthetic", "replace", "seed_everything"]
