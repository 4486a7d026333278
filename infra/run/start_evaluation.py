"""One evaluation of a shared start: the start and post-SFT evaluations stored under a key, reused by every run
that starts from the same weights under the same evaluation settings (issue 52, item 2).

In a sweep every cell that starts from the same weights (the demo base with ``train.sft.seed`` fixed, or
``model.name`` pointing at a shared SFT directory) evaluated that start again: the same weights, questions and
sampling seeds, about a quarter of a cell's evaluation time at 112 questions × 2 samples. Now the first run that
evaluates a start stores the per-question results under ``<runs_dir>/cache/start_eval/<key>/`` and the others read
them back: the same outcomes give the same report (:func:`~infra.run.evaluation.eval_report`), logged into each
run as a fresh one would be (metrics at the same step, the JSON report, the per-question Parquet that the paired
final − start / final − sft comparisons read), plus the tags ``start_eval/<stage>/<dataset>/key`` and, when read
back, ``.../reused_from`` (the run that sampled it). What a reused evaluation does not log again is its MLflow
traces (``tracking.eval_traces``): they are in the run it names.

The key (:class:`StartEvalKey`) is the weights' digest (:func:`~infra.models.weights_digest`, ~0.9 s for
SmolLM2-135M in float32 on one Zen 4 core) and every setting that changes the evaluation's result; a run that
changes any of them evaluates itself. The code version is not in it: after a change to sampling, tools or scoring
code, delete ``<runs_dir>/cache/start_eval``.

An entry is written whole or not at all (a hidden directory renamed into place, its manifest written last, the
Parquet's SHA-256 in the manifest); a damaged or partial one is ignored with a warning and computed again. Runs that
share the runs dir take the entry's lock (``<runs_dir>/locks/start_eval-<key>.lock``, waiting) for the lookup, the
evaluation and the write, so of two concurrent cells one samples and the other reads what it wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from aepo_core.evaluation import QuestionOutcome
from aepo_core.rollout.scheduler import derive_seed
from infra.atomic import atomic_dir
from infra.data.rows import QuestionRow
from infra.models import chat_prompt_template, weights_digest
from infra.run.evaluation import (
    QUESTION_SCHEMA,
    EvalReport,
    EvalSource,
    eval_report,
    eval_rollout_config,
    evaluated_rows,
    question_rows,
)
from infra.run.lock import held
from infra.run.runtime import PolicyRuntime

log = logging.getLogger(__name__)

START_STAGES = ("start", "sft")
"""The evaluations of a run's starting weights: before training (or before SFT) and after cold-start SFT."""
STORE_DIR = Path("cache") / "start_eval"
"""Under the runs dir: one directory per stored evaluation, named by its key."""
MANIFEST = "manifest.json"
QUESTIONS = "questions.parquet"
FORMAT = 1

UNREAD_ROLLOUT_FIELDS = frozenset({"mode", "initial_rollouts", "premonitor", "probe", "budget_rule",
                                   "root_sample_tokens", "beta", "gamma", "tau", "branch_penalty", "beam_size",
                                   "temperature", "top_p", "top_k"})
"""Rollout fields an evaluation does not read: it samples ``eval.n_samples`` independent paths (no pre-monitoring,
no branching) at ``eval.temperature`` / ``eval.top_p`` with no top-k (:func:`~infra.run.evaluation.evaluate_dataset`),
so the arms of a sweep that differ only here (AEPO vs ARPO vs GRPO, the ablations) share their start's evaluation."""
VLLM_OPERATIONAL = frozenset({"port", "startup_timeout_s", "max_restarts", "python"})
"""Fields of ``rollout.vllm`` that say how the server is run, not what it samples."""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()


@dataclass(frozen=True)
class StartEvalKey:
    """What one evaluation's result depends on: two evaluations with equal keys give the same samples and report.

    Config sections are held as canonical JSON (sorted keys) of the fields that matter; the questions, the
    tokenizer and the weights as digests."""

    weights: str
    """:func:`~infra.models.weights_digest` of the policy evaluated (every tensor's name, dtype, shape and bytes)."""
    prompt: str
    """Digest of the tokenizer's vocabulary, the rollout prompt's chat template and the agent protocol."""
    dataset: str
    """The dataset spec evaluated."""
    questions: str
    """Digest of the rows evaluated (ids, questions, golds, families: the first ``eval.max_questions``)."""
    task: str
    """``data.synthetic`` and ``data.data_root`` as JSON: the synthetic world the search tool reads."""
    n_samples: int
    pass_k: int
    temperature: float
    top_p: float
    max_questions: int | None
    bootstrap_samples: int
    batch_size: int
    """Questions per rollout batch (samples are meant not to depend on it; kept in the key to be safe under bf16)."""
    rollout: str
    """The evaluation's rollout config as JSON, less :data:`UNREAD_ROLLOUT_FIELDS` and :data:`VLLM_OPERATIONAL`:
    token budgets, tool-call limits, segment cap, entropy window and scale, KV reuse, engine and server dtype."""
    tools: str
    """``tools`` as JSON."""
    reward: str
    """``reward`` as JSON (the evaluation's correctness, EM and F1)."""
    numerics: str
    """The resolved compute, generation and vLLM dtypes (and the rollouts' sampler under ``eval.sampler:
    rollout``), ``model.attn_implementation``, ``train.deterministic``."""
    device: str
    """Where it computes: the policy's device, the device's name and kernel capability, torch's threads."""
    sampling_seed: int
    """The evaluation's sampling seed, ``derive_seed(seed, "eval", dataset)`` (each question's own derives from it)."""
    bootstrap_seed: int
    """The seed of the confidence intervals (the run's ``seed``)."""

    @property
    def name(self) -> str:
        """The key as a 32-hex-digit name (the entry's directory and lock)."""
        return _digest(asdict(self))[:32]


def prompt_digest(runtime: PolicyRuntime) -> str:
    """What turns a question into the tokens the policy sees, and its output back: the vocabulary, the rollout
    prompt's template and the agent protocol."""
    vocab = sorted(runtime.tokenizer.get_vocab().items())  # type: ignore[attr-defined]
    template = chat_prompt_template(runtime.tokenizer, runtime.protocol.system_prompt)
    return _digest([vocab, template, runtime.protocol.as_dict()])


def questions_digest(rows: list[QuestionRow]) -> str:
    return _digest([[r.id, r.question, list(r.golds), r.family] for r in rows])


def start_eval_key(runtime: PolicyRuntime, dataset: str, rows: list[QuestionRow], weights: str,
                   prompt: str) -> StartEvalKey:
    """The key of evaluating ``rows`` (:func:`~infra.run.evaluation.evaluated_rows`) of ``dataset`` with the
    runtime's config on weights of digest ``weights`` (``prompt``: :func:`prompt_digest`)."""
    cfg, ev, numerics = runtime.cfg, runtime.cfg.eval, runtime.numerics
    rollout = eval_rollout_config(cfg.rollout, ev).model_dump(
        mode="json", exclude={**dict.fromkeys(UNREAD_ROLLOUT_FIELDS, True), "vllm": set(VLLM_OPERATIONAL)})
    facts = numerics.facts
    device = next(runtime.model.parameters()).device
    return StartEvalKey(
        weights=weights, prompt=prompt, dataset=dataset, questions=questions_digest(rows),
        task=_canonical({"synthetic": cfg.data.synthetic.model_dump(mode="json") if runtime.task else None,
                         "data_root": cfg.data.data_root}),
        n_samples=ev.n_samples, pass_k=ev.pass_k, temperature=ev.temperature, top_p=ev.top_p,
        max_questions=ev.max_questions, bootstrap_samples=ev.bootstrap_samples,
        batch_size=ev.batch_size or cfg.train.batch_size, rollout=_canonical(rollout),
        tools=_canonical(cfg.tools.model_dump(mode="json")), reward=_canonical(cfg.reward.model_dump(mode="json")),
        numerics=_canonical({**_eval_numerics(runtime), "attn_implementation": cfg.model.attn_implementation,
                             "deterministic": cfg.train.deterministic}),
        device=_canonical([str(device), facts.name, facts.capability, torch.get_num_threads()]),
        sampling_seed=derive_seed(cfg.seed, "eval", dataset), bootstrap_seed=cfg.seed)


def _eval_numerics(runtime: PolicyRuntime) -> dict[str, str]:
    """The dtypes the evaluation's engine computes in: the policy's (compute, generation, vLLM), and the rollouts'
    sampler only when ``eval.sampler: rollout`` evaluates with it (the training arms' rollout correction and
    sampler are not the evaluation's)."""
    n = runtime.numerics
    used = {"compute": n.compute_dtype, "generation": n.generation_dtype, "vllm": n.vllm_dtype}
    return used | ({"sampler": n.sampler_dtype} if runtime.cfg.eval.sampler == "rollout" else {})


@dataclass(frozen=True)
class StoredOrigin:
    """Which run sampled a stored evaluation, at which stage, under which key (:attr:`StartEvalKey.name`)."""

    run_id: str
    run_name: str
    stage: str
    key: str

    def line(self) -> str:
        """``<run id> (<run name>, <stage>)``: the ``reused_from`` tag."""
        return f"{self.run_id} ({self.run_name}, {self.stage})"


@dataclass(frozen=True)
class StoredEvaluation:
    """An entry read back whole: who sampled it and its per-question rows (:data:`QUESTION_SCHEMA`)."""

    origin: StoredOrigin
    rows: list[dict[str, Any]]


class DamagedEntry(ValueError):
    """A stored evaluation that is partial, altered or not of its key."""


class StartEvalStore:
    """The stored start evaluations of one runs dir (see the module docstring)."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = runs_dir
        self.root = runs_dir / STORE_DIR

    def entry(self, key: StartEvalKey) -> Path:
        return self.root / key.name

    def claimed(self, key: StartEvalKey) -> AbstractContextManager[Path]:
        """The entry's lock, waited for: one run at a time looks it up, computes and writes it."""
        return held(self.runs_dir, "start_eval", key.name, f"start evaluation {key.name}", wait=True)

    def load(self, key: StartEvalKey) -> StoredEvaluation | None:
        """The entry of ``key``; None when there is none, or (with a warning) when it is damaged or partial."""
        where = self.entry(key)
        if not where.exists():
            return None
        try:
            return self._read(where, key)
        except (DamagedEntry, OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            log.warning("stored start evaluation %s is damaged (%s): evaluating again", where, exc)
            return None

    def _read(self, where: Path, key: StartEvalKey) -> StoredEvaluation:
        manifest = json.loads((where / MANIFEST).read_text())
        if manifest.get("format") != FORMAT or manifest.get("key") != asdict(key):
            raise DamagedEntry("its manifest is of another format or key")
        data = (where / QUESTIONS).read_bytes()
        if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
            raise DamagedEntry(f"{QUESTIONS} does not match its manifest's SHA-256")
        rows = pq.read_table(pa.BufferReader(data)).to_pylist()
        if len(rows) != manifest["questions"]:
            raise DamagedEntry(f"{len(rows)} question rows, the manifest says {manifest['questions']}")
        return StoredEvaluation(StoredOrigin(**manifest["origin"]), rows)

    def save(self, key: StartEvalKey, report: EvalReport, origin: StoredOrigin) -> None:
        """Store ``report`` under ``key``: the per-question Parquet, then the manifest, in a hidden directory renamed
        into place (replacing a damaged entry)."""
        source = EvalSource(origin.run_id, origin.run_name, None, 0, origin.stage)
        table = pa.Table.from_pylist(question_rows(report, key.pass_k, source), schema=QUESTION_SCHEMA)
        with atomic_dir(self.entry(key), replace=True) as tmp:
            pq.write_table(table, tmp / QUESTIONS, compression="zstd")
            manifest = {"format": FORMAT, "key": asdict(key), "origin": asdict(origin), "questions": table.num_rows,
                        "sha256": hashlib.sha256((tmp / QUESTIONS).read_bytes()).hexdigest(),
                        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def stored_report(runtime: PolicyRuntime, dataset: str, rows: list[QuestionRow], stored: StoredEvaluation
                  ) -> EvalReport:
    """The report a fresh evaluation of ``rows`` would give, from the stored outcomes (in row order)."""
    if [r["question_id"] for r in stored.rows] != [r.id for r in rows]:
        raise DamagedEntry("its questions are not the ones evaluated")
    outcomes = [QuestionOutcome(r["question_id"], dataset, r["family"], r["n"], r["correct"], r["em"], r["f1"],
                                r["tool_calls_mean"], r["tool_error_rate"], r["answered_rate"]) for r in stored.rows]
    answers = {r["question_id"]: list(r["answers"]) for r in stored.rows}
    return eval_report(runtime, dataset, rows, outcomes, answers, runtime.cfg.eval, runtime.cfg.seed)


@dataclass(frozen=True)
class StartReport:
    """A start stage's evaluation of one dataset: the report, its key's name, and the run it was read from (None:
    sampled by this run)."""

    report: EvalReport
    key: str
    reused_from: StoredOrigin | None = None


@dataclass
class SharedStart:
    """The start evaluations of one stage of a run: its weights' digest taken once, each dataset looked up, else
    evaluated and stored (:meth:`evaluate`)."""

    store: StartEvalStore
    runtime: PolicyRuntime
    weights: str
    prompt: str
    digest_s: float = 0.0
    keys: dict[str, StartEvalKey] = field(default_factory=dict)

    @classmethod
    def of(cls, runtime: PolicyRuntime, runs_dir: Path) -> SharedStart:
        t0 = time.perf_counter()
        weights = weights_digest(runtime.model)
        digest_s = time.perf_counter() - t0
        return cls(StartEvalStore(runs_dir), runtime, weights, prompt_digest(runtime), digest_s)

    def evaluate(self, dataset: str, source: EvalSource, stage: str, compute: Callable[[], EvalReport]
                 ) -> StartReport:
        """``dataset``'s evaluation read back from the store when an entry of its key is there and whole, else
        ``compute()`` d and stored as sampled by ``source`` at ``stage``; under the entry's lock."""
        rows = evaluated_rows(self.runtime.load_rows(dataset), self.runtime.cfg.eval)
        key = self.keys[dataset] = start_eval_key(self.runtime, dataset, rows, self.weights, self.prompt)
        with self.store.claimed(key):
            stored = self.store.load(key)
            if stored is not None:
                try:
                    return StartReport(stored_report(self.runtime, dataset, rows, stored), key.name, stored.origin)
                except (DamagedEntry, KeyError, TypeError, ValueError) as exc:
                    log.warning("stored start evaluation %s is damaged (%s): evaluating again",
                                self.store.entry(key), exc)
            report = compute()
            self.store.save(key, report, StoredOrigin(source.eval_run_id, source.eval_run_name, stage, key.name))
            return StartReport(report, key.name)
