"""Evaluating the policy on one dataset: n samples per question → unbiased Pass@1 / Pass@k with bootstrap CIs,
and the per-question Parquet file of an evaluation.

Plain functions of a :class:`~infra.run.runtime.PolicyRuntime`: they need no training data and no trainer, so the
train flow's in-run evaluations and ``aepo eval`` of a checkpoint run the same code and write the same files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from aepo_core.config import EvalConfig, RolloutConfig, StorageConfig
from aepo_core.evaluation import EvalSummary, PairedDiff, QuestionOutcome, is_correct, summaries_by
from aepo_core.interfaces import RewardFn, RewardResult, SamplingParams
from aepo_core.metrics import pass_at_k
from aepo_core.rewards import predicted_answer
from aepo_core.rollout.scheduler import derive_seed
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore, model_text
from infra.atomic import atomic_file
from infra.data.loaders import dataset_key
from infra.data.rows import QuestionRow
from infra.fs import is_remote, open_fs, put_file, storage_errors, storage_options
from infra.judge import LLMJudge, Verdict
from infra.run.runtime import PolicyRuntime
from infra.store import column, table_schema

EVAL_STAGING = Path("cache") / "eval"
"""Under the runs dir: the local copy of results bound for a remote ``storage.evaluations_uri``."""

_LIST = pa.list_(pa.string())
QUESTION_SCHEMA = table_schema("eval_questions", [
    column("eval_run_id", pa.string(), "The MLflow run that evaluated: aepo eval's own run, or for an "
           "evaluation during training the training run.", False),
    column("eval_run_name", pa.string(), "That run's name (also the folder under runs/eval/).", False),
    column("checkpoint", pa.string(), "The checkpoint evaluated (a path, s3:// URI or models:/ URI); null: "
           "the configured model as loaded, or during training the live policy."),
    column("checkpoint_step", pa.int64(), "The RL step of the weights evaluated (0: before any RL step).",
           False),
    column("stage", pa.string(), "Which evaluation of the run: start (before SFT), sft (after it), stepN "
           "(eval.every), final, or eval (aepo eval). Files written before this column (schema version 1) "
           "lack it.", False),
    column("dataset", pa.string(), "The dataset as configured (a shipped name, a path or synthetic:<split>).",
           False),
    column("question_id", pa.string(), "The question's id within its dataset.", False),
    column("family", pa.string(), "The question's family (synthetic: single_hop / two_hop / compute; verl "
           "data: its ability).", False),
    column("question", pa.string(), "The question text.", False),
    column("golds", _LIST, "The accepted answers.", False),
    column("n", pa.int32(), "Samples drawn for the question (eval.n_samples).", False),
    column("correct", pa.int32(), "Samples whose answer was scored correct (reward.kind's check).", False),
    column("k", pa.int32(), "The k of pass_at_k (eval.pass_k).", False),
    column("pass_at_1", pa.float64(), "correct / n: the unbiased Pass@1 estimate.", False),
    column("pass_at_k", pa.float64(), "The unbiased Pass@k estimate 1 − C(n−c, k) / C(n, k), k ≤ n.", False),
    column("em", pa.float64(), "Exact match of the final answer, mean over samples.", False),
    column("f1", pa.float64(), "Token F1 of the final answer against the best gold, mean over samples.",
           False),
    column("tool_calls_mean", pa.float64(), "Tool calls per sample, mean.", False),
    column("tool_error_rate", pa.float64(), "Share of tool calls that returned an error.", False),
    column("answered_rate", pa.float64(), "Share of samples that gave a final answer.", False),
    column("answers", _LIST, "Each sample's final answer, in sample order (null where it gave none)."),
    column("judge_verdicts", _LIST, "The LLM judge's verdict per sample: correct, incorrect, no_answer, "
           "unparsed or error (null without eval.judge)."),
    column("judge_raw", _LIST, "The judge's raw reply per sample (null without eval.judge)."),
    column("judge_correct", pa.int32(), "Samples the judge accepted (null without eval.judge)."),
    column("judge_pass_at_1", pa.float64(), "judge_correct / n (null without eval.judge)."),
], version="2")
"""One row per question of one dataset; each column's description travels in the schema and in every file written
(``aepo.columns``), and the docs' reference lists them (docs: Reference, Parquet tables)."""


@dataclass(frozen=True)
class TracedSamples:
    """The samples of an evaluation's first questions, kept to be logged as MLflow traces: their trees, each
    sample's reward and reason (advantage NaN: evaluation computes none), and the questions' rows by id."""

    trees: list[RolloutTree]
    scores: list[list[LeafScore]]
    questions: dict[str, QuestionRow]


@dataclass(frozen=True)
class EvalReport:
    """One dataset's evaluation.

    ``dataset`` is the spec as configured and ``key`` its name in metrics, files and tables
    (:func:`~infra.data.loaders.dataset_key`); ``summary`` holds Pass@1 / Pass@k with CIs, EM, F1 and tool use
    over questions, ``by_family`` the same per question family; ``per_question_pass1``, ``answers`` (each
    sample's final answer, None when it gave none) and ``questions`` (the rows evaluated) are keyed by question id.
    """

    dataset: str
    key: str
    summary: EvalSummary
    by_family: dict[str, EvalSummary]
    outcomes: list[QuestionOutcome]
    per_question_pass1: dict[str, float] = field(default_factory=dict)
    answers: dict[str, list[str | None]] = field(default_factory=dict)
    questions: dict[str, QuestionRow] = field(default_factory=dict)
    traced: TracedSamples | None = None

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """``<prefix>/<key>/<summary name>``: the names under which MLflow records this report."""
        return {f"{prefix}/{self.key}/{name}": value for name, value in self.summary.as_dict().items()}

    def as_dict(self) -> dict[str, object]:
        """The report as JSON (``eval/<stage>/<key>.json``): summary, per family, per question."""
        return {"summary": self.summary.as_dict(),
                "by_family": {family: s.as_dict() for family, s in self.by_family.items()},
                "questions": [o.as_dict() for o in self.outcomes]}


def eval_rollout_config(rollout: RolloutConfig, ev: EvalConfig) -> RolloutConfig:
    """The rollout config of evaluation: ``eval.n_samples`` independent samples per question at the evaluation
    sampling (no branching: Pass@k needs independent samples)."""
    return rollout.model_copy(update={"mode": "independent", "k": ev.n_samples,
                                      "initial_rollouts": min(rollout.initial_rollouts, ev.n_samples),
                                      "temperature": ev.temperature, "top_p": ev.top_p})


def evaluate_dataset(runtime: PolicyRuntime, dataset: str, rows: Sequence[QuestionRow], ev: EvalConfig,
                     seed: int, batch_size: int, traces: int = 0) -> EvalReport:
    """Sample ``ev.n_samples`` answers per row in batches of ``batch_size`` questions and summarize them; the
    samples of the first ``traces`` questions are kept in the report (:class:`TracedSamples`).

    Seeds derive from (seed, dataset) and, inside the rollout, each question's id: an evaluation repeats exactly for
    the same weights, and a question's samples do not depend on the batch size or the other questions.
    """
    rows = evaluated_rows(rows, ev)
    rollout = eval_rollout_config(runtime.cfg.rollout, ev)
    outcomes: list[QuestionOutcome] = []
    answers: dict[str, list[str | None]] = {}
    traced = TracedSamples([], [], {})
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        result = runtime.sample(chunk, rollout, derive_seed(seed, "eval", dataset),
                                SamplingParams(ev.temperature, ev.top_p, 0), engine=runtime.eval_engine)
        for row, tree in zip(chunk, result.trees, strict=True):
            rewards = leaf_rewards(row, tree, runtime.reward_fn)
            outcomes.append(question_outcome(dataset, row, tree, rewards))
            answers[row.id] = [predicted_answer(model_text(tree, leaf)) for leaf in tree.leaves]
            if len(traced.trees) < traces:
                traced.trees.append(tree)
                traced.scores.append([LeafScore(r.score, r.reason, math.nan, is_correct(r)) for r in rewards])
                traced.questions[row.id] = row
    return eval_report(runtime, dataset, rows, outcomes, answers, ev, seed, traced if traces else None)


def evaluated_rows(rows: Sequence[QuestionRow], ev: EvalConfig) -> list[QuestionRow]:
    """The rows an evaluation samples: the first ``eval.max_questions`` (all when None)."""
    return list(rows)[: ev.max_questions] if ev.max_questions else list(rows)


def eval_report(runtime: PolicyRuntime, dataset: str, rows: Sequence[QuestionRow], outcomes: list[QuestionOutcome],
                answers: dict[str, list[str | None]], ev: EvalConfig, seed: int,
                traced: TracedSamples | None = None) -> EvalReport:
    """The report of ``rows``' outcomes (in row order) and answers: summaries with bootstrap CIs seeded by ``seed``,
    per family, per-question Pass@1, the dataset's key among the runtime's evaluated datasets. The same outcomes
    give the same report, sampled now or read back from a stored evaluation (:mod:`infra.run.start_evaluation`)."""
    summary = EvalSummary.of(outcomes, ev.pass_k, n_resamples=ev.bootstrap_samples, seed=seed)
    by_family = summaries_by(outcomes, "family", ev.pass_k, n_resamples=ev.bootstrap_samples, seed=seed)
    pass1 = {o.question_id: o.correct / o.n for o in outcomes}
    key = dataset_key(dataset, among=runtime.eval_datasets())  # unique among the datasets evaluated together
    return EvalReport(dataset, key, summary, by_family, outcomes, pass1, answers, {r.id: r for r in rows}, traced)


def leaf_rewards(row: QuestionRow, tree: RolloutTree, reward_fn: RewardFn) -> list[RewardResult]:
    """Each sample's reward (tool calls without the scheduler's notices)."""
    out = []
    for leaf in tree.leaves:
        events = [e for e in tree.tool_events(leaf) if not e.is_notice]
        out.append(reward_fn(tree.text(leaf), list(row.golds), [e.name for e in events],
                             model_text=model_text(tree, leaf)))
    return out


def question_outcome(dataset: str, row: QuestionRow, tree: RolloutTree, rewards: Sequence[RewardResult]
                     ) -> QuestionOutcome:
    """One question's samples (``rewards``: :func:`leaf_rewards`): how many are correct, mean EM / F1, tool calls,
    tool errors, answered share."""
    correct = em = f1 = calls = errors = answered = 0.0
    n_calls = 0
    for leaf, res in zip(tree.leaves, rewards, strict=True):
        events = [e for e in tree.tool_events(leaf) if not e.is_notice]
        correct += is_correct(res)
        em += res.details.get("em", float(is_correct(res)))
        f1 += res.details.get("f1", float(is_correct(res)))
        calls += len(events)
        n_calls += len(events)
        errors += sum(1 for e in events if not e.ok)
        answered += leaf.status == "answered"
    n = len(tree.leaves)
    return QuestionOutcome(row.id, dataset, row.family, n, int(correct), em / n, f1 / n, calls / n,
                           errors / n_calls if n_calls else 0.0, answered / n)


@dataclass(frozen=True)
class ResultsDir:
    """Where one evaluation's per-question files go: ``uri`` (a local directory or ``s3://…``) and ``local``, the
    directory each file is written to first (``uri`` itself, or for a remote ``uri`` its staging copy under
    ``<runs_dir>/cache/eval/``: a remote file is sent as one PUT once whole)."""

    uri: str
    local: Path

    @classmethod
    def of(cls, storage: StorageConfig, runs: Path, name: str) -> ResultsDir:
        """``<storage.evaluations_uri or runs_dir/eval>/<name>``."""
        uri = f"{(storage.evaluations_uri or str(runs / 'eval')).rstrip('/')}/{name}"
        return cls(uri, runs / EVAL_STAGING / name if is_remote(uri) else Path(uri))

    def local_file(self, key: str) -> Path:
        """The local per-question file of dataset ``key`` (what MLflow logs)."""
        return self.local / f"{key}.parquet"


@dataclass(frozen=True)
class EvalSource:
    """What an evaluation's rows say about its origin: the MLflow run that evaluated, what it evaluated and which of
    the run's evaluations it is (the ``eval_run_id``, ``eval_run_name``, ``checkpoint``, ``checkpoint_step`` and
    ``stage`` columns)."""

    eval_run_id: str
    eval_run_name: str
    checkpoint: str | None
    checkpoint_step: int
    stage: str


def question_rows(report: EvalReport, k: int, source: EvalSource,
                  verdicts: Mapping[str, Sequence[Verdict]] | None = None) -> list[dict[str, Any]]:
    """The rows of :data:`QUESTION_SCHEMA` for one report (``verdicts``: the judge's, per question and sample)."""
    base = asdict(source)
    out = []
    for o in report.outcomes:
        row = report.questions[o.question_id]
        v = verdicts.get(o.question_id) if verdicts is not None else None
        judged = sum(x.correct for x in v) if v is not None else None
        out.append({**base, "dataset": report.dataset, "question_id": o.question_id, "family": o.family,
                    "question": row.question, "golds": list(row.golds), "n": o.n, "correct": o.correct, "k": k,
                    "pass_at_1": pass_at_k(o.n, o.correct, 1), "pass_at_k": pass_at_k(o.n, o.correct, min(k, o.n)),
                    "em": o.em_mean, "f1": o.f1_mean, "tool_calls_mean": o.tool_calls_mean,
                    "tool_error_rate": o.tool_error_rate, "answered_rate": o.answered_rate,
                    "answers": report.answers.get(o.question_id),
                    "judge_verdicts": [x.verdict for x in v] if v is not None else None,
                    "judge_raw": [x.raw for x in v] if v is not None else None,
                    "judge_correct": judged, "judge_pass_at_1": judged / o.n if v is not None else None})
    return out


def write_question_results(report: EvalReport, k: int, source: EvalSource, where: ResultsDir,
                           storage: StorageConfig, verdicts: Mapping[str, Sequence[Verdict]] | None = None) -> str:
    """``<where>/<report.key>.parquet`` with one :data:`QUESTION_SCHEMA` row per question, written atomically
    (temporary name in the same directory, fsync, rename), then for a remote ``where`` sent as one PUT; returns
    the file's location."""
    table = pa.Table.from_pylist(question_rows(report, k, source, verdicts), schema=QUESTION_SCHEMA)
    local = where.local_file(report.key)
    with atomic_file(local) as fh:
        pq.write_table(table, fh, compression="zstd")
    if not is_remote(where.uri):
        return str(local)
    uri = f"{where.uri}/{report.key}.parquet"
    return put_file(local, uri, storage_options(storage, uri))


def read_question_results(path: str | os.PathLike[str], storage: StorageConfig | None = None
                          ) -> dict[str, dict[str, float]]:
    """Per-question Pass@1 of a previous evaluation (a ``<dataset>.parquet`` or its run directory, local or
    remote), by dataset."""
    text = str(path)
    fs, root = open_fs(text if is_remote(text) else Path(text).expanduser(),
                       storage_options(storage, text) if storage is not None else None)
    with storage_errors(text, "cannot read"):
        fs.invalidate_cache(root)
        files = sorted(fs.glob(f"{root}/*.parquet")) if fs.isdir(root) else [root]
        found = bool(files) and all(fs.isfile(f) for f in files)
    if not found:
        raise FileNotFoundError(f"{text}: no per-question Parquet file there")
    out: dict[str, dict[str, float]] = {}
    with storage_errors(text, "cannot read"):
        for f in files:
            table = pq.read_table(f, columns=["dataset", "question_id", "pass_at_1"], filesystem=fs).to_pylist()
            for row in table:
                out.setdefault(row["dataset"], {})[row["question_id"]] = float(row["pass_at_1"])
    return out


def recorded_pass1(where: ResultsDir, storage: StorageConfig, specs: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per-question Pass@1 of an evaluation already written at ``where``, by dataset key among ``specs`` (the
    datasets evaluated together); empty when nothing was written there."""
    try:
        by_spec = read_question_results(where.uri, storage)
    except FileNotFoundError:
        return {}
    return {dataset_key(spec, among=specs): pass1 for spec, pass1 in by_spec.items()}


def check_comparable(specs: Sequence[str], previous: Mapping[str, object] | None, compare_to: str | None) -> None:
    """Refuse an evaluation before it starts when the datasets are none and when ``compare_to`` (read into
    ``previous``, by dataset) holds none of them."""
    if not specs:
        raise ValueError("nothing to evaluate: set eval.datasets (or data.validation)")
    if previous is not None and not set(previous) & set(specs):
        raise ValueError(f"compare_to {compare_to} holds datasets {sorted(previous)}, none of {list(specs)}")


def judge_report(judge: LLMJudge, report: EvalReport) -> dict[str, list[Verdict]]:
    """Every sample's final answer through the LLM judge: per question, one verdict per sample."""
    answers, questions = report.answers, report.questions
    items = [(questions[q].question, list(questions[q].golds), a) for q in answers for a in answers[q]]
    flat = judge.judge_many(items)
    verdicts, pos = {}, 0
    for q, samples in answers.items():
        verdicts[q] = flat[pos: pos + len(samples)]
        pos += len(samples)
    return verdicts


def judge_pass1(verdicts: Mapping[str, Sequence[Verdict]]) -> float:
    """Mean over questions of the share of samples the judge called correct."""
    return sum(sum(v.correct for v in vs) / len(vs) for vs in verdicts.values()) / len(verdicts)


@dataclass(frozen=True)
class EvalResult:
    """What an evaluation produced and where it went; per-dataset fields are keyed by the dataset key
    (:func:`~infra.data.loaders.dataset_key`: ``synthetic_test``)."""

    run_id: str
    run_name: str
    checkpoint: str | None
    checkpoint_step: int
    runs_dir: str
    results_dir: str
    tracking_uri: str
    pass_k: int
    files: dict[str, str] = field(default_factory=dict)
    summaries: dict[str, EvalSummary] = field(default_factory=dict)
    families: dict[str, dict[str, EvalSummary]] = field(default_factory=dict)
    judge: dict[str, float] = field(default_factory=dict)
    comparisons: dict[str, PairedDiff] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, dict[str, float]]:
        """The summaries serialized (:meth:`EvalSummary.as_dict`), by dataset key."""
        return {key: s.as_dict() for key, s in self.summaries.items()}

    @property
    def by_family(self) -> dict[str, dict[str, dict[str, float]]]:
        return {key: {f: s.as_dict() for f, s in by.items()} for key, by in self.families.items()}

    @property
    def compare(self) -> dict[str, dict[str, float]]:
        """The paired comparisons serialized (:meth:`PairedDiff.as_dict`), by dataset key."""
        return {key: c.as_dict() for key, c in self.comparisons.items()}

    @property
    def source(self) -> EvalSource:
        """What this evaluation's per-question rows say about their origin."""
        return EvalSource(self.run_id, self.run_name, self.checkpoint, self.checkpoint_step, "eval")

    def record(self, report: EvalReport, verdicts: Mapping[str, Sequence[Verdict]] | None,
               previous: Mapping[str, Mapping[str, float]] | None, ev: EvalConfig, seed: int) -> dict[str, float]:
        """Keep one dataset's summaries, its judge's Pass@1 (with ``verdicts``) and its paired comparison with
        ``previous`` (an earlier evaluation's per-question Pass@1, by dataset spec, when it holds this one); returns
        the metrics MLflow records for it: ``eval/<key>/…``, ``eval/<key>/judge_pass@1``, ``compare/<key>/pass@1_…``."""
        metrics = report.metrics()
        if verdicts is not None:
            self.judge[report.key] = judge_pass1(verdicts)
            metrics[f"eval/{report.key}/judge_pass@1"] = self.judge[report.key]
        if previous is not None and report.dataset in previous:
            cmp = PairedDiff.of(report.per_question_pass1, previous[report.dataset],
                                n_resamples=ev.bootstrap_samples, seed=seed)
            self.comparisons[report.key] = cmp
            metrics.update({f"compare/{report.key}/pass@1_{key}": v for key, v in cmp.as_dict().items()})
        self.summaries[report.key], self.families[report.key] = report.summary, report.by_family
        return metrics


    def summary_json(self, compare_to: str | None) -> dict[str, object]:
        """``eval/summary.json``: the summaries, the judge's Pass@1 and the paired comparisons."""
        return {"summary": self.summary, "by_family": self.by_family, "judge_pass@1": self.judge,
                "compare": self.compare, "compare_to": compare_to}
