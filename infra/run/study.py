"""The rollout study's per-question table on disk (Parquet) and its summary (JSON-ready), see :mod:`flows.study`.

One row per (k, sampling mode, question): the :class:`~aepo_core.rollout.study.GroupProfile` of that question's
rollout group, plus the cost of the chunk it was sampled in. The summary is recomputed from this table alone, so
``--analyse-only`` re-analyses a study without sampling again.

:class:`StudyFolder` is a study's folder as it fills (settings, profiles and costs after every chunk, resumed under
the same run name), :func:`study_questions` the questions it samples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from aepo_core.config import RolloutConfig
from aepo_core.rollout.rows import null_nan
from aepo_core.rollout.study import (
    NAN_ESTIMATE,
    QUANTITIES,
    Estimate,
    GroupProfile,
    ModeSummary,
    paired_difference,
    summarize_mode,
)
from infra.atomic import atomic_file
from infra.data.rows import QuestionRow
from infra.models import weights_digest
from infra.run.runtime import PolicyRuntime

PROFILE_SCHEMA = pa.schema(
    [
        pa.field("k", pa.int32(), nullable=False).with_metadata({"doc": "group size: leaves per question"}),
        pa.field("mode", pa.string(), nullable=False).with_metadata({"doc": "aepo | arpo | independent"}),
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("leaves", pa.int32(), nullable=False).with_metadata({"doc": "trajectories of the group"}),
        pa.field("branch_points", pa.int32(), nullable=False).with_metadata(
            {"doc": "tool-result nodes that forks started from"}),
        pa.field("top1_share", pa.float64()).with_metadata(
            {"doc": "share of the branch points on the path holding most of them; null without branch points"}),
        pa.field("top3_share", pa.float64()).with_metadata(
            {"doc": "share on the union of the 3 paths holding most; null without branch points"}),
        pa.field("max_branches_on_path", pa.int32(), nullable=False),
        pa.field("consecutive", pa.list_(pa.int32()), nullable=False).with_metadata(
            {"doc": "per branch created: the branches created just before it on its path (l)"}),
        pa.field("distinct_tool_sequences", pa.int32(), nullable=False).with_metadata(
            {"doc": "distinct (tool, normalized argument) sequences among the leaves"}),
        pa.field("distinct_answers", pa.int32(), nullable=False).with_metadata(
            {"doc": "distinct normalized final answers among the leaves that gave one"}),
        pa.field("correct", pa.int32(), nullable=False).with_metadata({"doc": "leaves with a correct answer"}),
        pa.field("mixed_rewards", pa.bool_(), nullable=False).with_metadata(
            {"doc": "the leaves' rewards are not all equal (the group carries a group-advantage signal)"}),
        pa.field("global_budget", pa.int32(), nullable=False).with_metadata({"doc": "m: global samples planned"}),
        pa.field("entropy_gap", pa.float64()).with_metadata({"doc": "H_root − H̄_tool of the tree"}),
        pa.field("model_tokens", pa.int64(), nullable=False).with_metadata(
            {"doc": "tokens the model sampled for the tree, shared prefixes once"}),
        pa.field("high_entropy_steps", pa.int32(), nullable=False).with_metadata(
            {"doc": "high-entropy tool steps (ΔH, the entropy rise over the path's first segment, above the median "
                    "of the tree's tool steps) that have a tool step before them on their path"}),
        pa.field("high_entropy_after_high", pa.int32(), nullable=False).with_metadata(
            {"doc": "of high_entropy_steps, those whose previous tool step was high-entropy too"}),
        pa.field("steps_after_tool", pa.int32(), nullable=False).with_metadata(
            {"doc": "tool steps that have a tool step before them on their path, high-entropy or not"}),
        pa.field("steps_after_high", pa.int32(), nullable=False).with_metadata(
            {"doc": "of steps_after_tool, those whose previous tool step was high-entropy (the chance level of "
                    "high_entropy_after_high / high_entropy_steps)"}),
        pa.field("branch_samples_by_root", pa.list_(pa.int32()), nullable=False).with_metadata(
            {"doc": "branch leaves per global root (first segment of their path) that has any, most first"}),
        pa.field("penalized", pa.int32(), nullable=False).with_metadata(
            {"doc": "branch decisions the consecutive-branch penalty turned off"}),
        pa.field("open_decisions_by_l", pa.list_(pa.int32()), nullable=False).with_metadata(
            {"doc": "index l: branch decisions taken with the budget open"}),
        pa.field("branches_by_l", pa.list_(pa.int32()), nullable=False).with_metadata(
            {"doc": "index l: of open_decisions_by_l, the ones that branched"}),
    ],
    metadata={"doc": "aepo rollout study: one row per (k, mode, question), see aepo_core/rollout/study.py"},
)

PROFILE_FIELDS = tuple(f.name for f in fields(GroupProfile))
LIST_FIELDS = tuple(f.name for f in PROFILE_SCHEMA if pa.types.is_list(f.type))
ADDED_IN_ISSUE_26 = ("high_entropy_steps", "high_entropy_after_high", "steps_after_tool", "steps_after_high",
                     "branch_samples_by_root", "penalized", "open_decisions_by_l", "branches_by_l")
"""Columns a study written before them lacks; read back as their empty defaults."""
HIGH_BY_MEDIAN = ("high_entropy_steps", "high_entropy_after_high")
"""Written with ΔH > 0 as the high-entropy test before steps_after_tool existed (and the median replaced it):
such files' values are not read, so quantity (a) is undefined for them rather than misread."""


@dataclass(frozen=True)
class Arm:
    """One sampling configuration of the study: a mode at a group size."""

    k: int
    mode: str

    @property
    def label(self) -> str:
        return f"k{self.k}/{self.mode}"


@dataclass(frozen=True)
class ArmCost:
    """What sampling an arm's questions cost: wall, engine and tool seconds, generated tokens (summed over chunks)."""

    wall_s: float
    generate_s: float
    tools_s: float
    tokens_generated: float


def write_profiles(path: str | Path, profiles: Mapping[Arm, Sequence[GroupProfile]]) -> Path:
    """The per-question table, atomically (complete or absent)."""
    rows = [
        {"k": arm.k, "mode": arm.mode,
         **{name: (list(v) if name in LIST_FIELDS else null_nan(v) if isinstance(v, float) else v)
            for name, v in asdict(p).items()}}
        for arm, ps in profiles.items() for p in ps
    ]
    table = pa.Table.from_pylist(rows, schema=PROFILE_SCHEMA)
    with atomic_file(path) as fh:
        pq.write_table(table, fh)
    return Path(path)


def read_profiles(path: str | Path) -> dict[Arm, list[GroupProfile]]:
    """The per-question table back, by arm (rows in file order)."""
    out: dict[Arm, list[GroupProfile]] = {}
    present = set(pq.read_schema(path).names)
    if "steps_after_tool" not in present:
        present -= set(HIGH_BY_MEDIAN)
    schema = pa.schema([f for f in PROFILE_SCHEMA if f.name in present or f.name not in ADDED_IN_ISSUE_26])
    for row in pq.read_table(path, schema=schema).to_pylist():
        values = {name: row[name] for name in PROFILE_FIELDS if name in row}
        for name in ("top1_share", "top3_share", "entropy_gap"):
            values[name] = math.nan if values[name] is None else values[name]
        for name in LIST_FIELDS:
            if name in values:
                values[name] = tuple(values[name])
        out.setdefault(Arm(row["k"], row["mode"]), []).append(GroupProfile(**values))
    return out


def _cost_json(cost: ArmCost) -> dict[str, float | None]:
    """An arm's cost for JSON: unknown parts (NaN) as null."""
    return {name: null_nan(v) for name, v in asdict(cost).items()}


def write_costs(path: str | Path, costs: Mapping[Arm, ArmCost]) -> Path:
    """Each arm's cost as JSON (``{"k8/aepo": {"wall_s": …}}``), atomically."""
    with atomic_file(path, "w") as fh:
        json.dump({arm.label: _cost_json(c) for arm, c in costs.items()}, fh, indent=1)
    return Path(path)


def read_costs(path: str | Path) -> dict[Arm, ArmCost]:
    """:func:`write_costs`'s file back; empty when there is none (a study from before it was written)."""
    file = Path(path)
    if not file.is_file():
        return {}
    out = {}
    for label, cost in json.loads(file.read_text()).items():
        k, mode = label.split("/", 1)
        out[Arm(int(k.removeprefix("k")), mode)] = ArmCost(**{f: math.nan if v is None else v for f, v in cost.items()})
    return out


def study_pairs(modes: Sequence[str]) -> list[tuple[str, str]]:
    """The paired differences (a, b), a − b on the same questions, reported at a k with these arms: every arm but
    the baselines against arpo, then every arm but independent against independent (with the default arms: aepo −
    arpo, aepo − independent, arpo − independent)."""
    pairs = [(a, "arpo") for a in modes if a not in ("arpo", "independent") and "arpo" in modes]
    return pairs + [(a, "independent") for a in modes if a != "independent" and "independent" in modes]


@dataclass(frozen=True)
class StudySummary:
    """Every arm's summary and the paired differences between modes at each k."""

    arms: dict[Arm, ModeSummary]
    diffs: dict[tuple[int, str, str], dict[str, Estimate]]  # (k, a, b) → quantity → a − b

    def to_json(self, costs: Mapping[Arm, ArmCost] | None = None) -> dict[str, object]:
        """A JSON-ready tree: ``arms[<k>/<mode>]`` (estimates, histogram, budget correlation, cost) and
        ``paired[<k>/<a>-<b>]``; NaN as null."""
        def est(e: Estimate) -> dict[str, float | int | None]:
            return {"mean": null_nan(e.mean), "low": null_nan(e.low), "high": null_nan(e.high),
                    "n": e.n}

        arms: dict[str, object] = {}
        for arm, s in self.arms.items():
            arms[arm.label] = {"estimates": {q: est(e) for q, e in s.estimates.items()},
                               "consecutive_histogram": {str(l_count): n for l_count, n
                                                         in s.consecutive_histogram.items()},
                               "budget_correlation": est(s.budget_correlation),
                               "branch_rate_by_l": {str(l_count): est(e) for l_count, e in s.branch_rate_by_l.items()},
                               "cost": _cost_json(costs[arm]) if costs and arm in costs else None}
        paired = {f"k{k}/{a}-{b}": {q: est(e) for q, e in d.items()} for (k, a, b), d in self.diffs.items()}
        return {"arms": arms, "paired": paired}


def summarize_study(profiles: Mapping[Arm, Sequence[GroupProfile]], n_resamples: int = 1000,
                    seed: int = 0) -> StudySummary:
    """Per arm: :func:`summarize_mode`; per k and pair of modes present: the paired difference of every quantity."""
    arms = {arm: summarize_mode(ps, n_resamples, seed) for arm, ps in profiles.items()}
    diffs: dict[tuple[int, str, str], dict[str, Estimate]] = {}
    for k in sorted({arm.k for arm in profiles}):
        for a, b in study_pairs([arm.mode for arm in profiles if arm.k == k]):
            if Arm(k, a) in profiles and Arm(k, b) in profiles:
                diffs[(k, a, b)] = {q: paired_difference(profiles[Arm(k, a)], profiles[Arm(k, b)], q, n_resamples,
                                                         seed) for q in QUANTITIES}
    return StudySummary(arms, diffs)


# ------------------------------------------------------------------------------------------------ figures
def study_panels(summary: StudySummary) -> dict[str, dict[str, dict[str, Estimate]]]:
    """The bar panels of the study figure: panel → series → arm label → estimate."""
    def series(quantity: str) -> dict[str, Estimate]:
        return {arm.label: s.estimates[quantity] for arm, s in summary.arms.items()}

    return {
        "branch concentration: share of a question's branch points": {
            "on its top-1 path": series("top1_share"), "on its top-3 paths": series("top3_share")},
        "branching per question": {"branch points": series("branch_points"),
                                   "most on one path": series("max_branches_on_path")},
        "consecutive branching": {"share of branches right after a branch (l ≥ 1)":
                                  series("consecutive_branch_share")},
        "exploration per group": {"distinct tool-call sequences": series("distinct_tool_sequences"),
                                  "distinct final answers": series("distinct_answers")},
        "outcome per group": {"Pass@k (any leaf correct)": series("pass_at_k"),
                              "informative (rewards differ)": series("informative"),
                              "leaf accuracy": series("accuracy")},
        "cost per question": {"model tokens sampled": series("model_tokens")},
        "the paper's quantities": {
            "high-entropy tool step after a high-entropy one": series("consecutive_high_entropy_share"),
            "branch samples from the top-3 global roots": series("branch_samples_top3_root")},
        "P(branch | l, budget open)": {
            f"l = {l_count}": {arm.label: s.branch_rate_by_l.get(l_count, NAN_ESTIMATE)
                               for arm, s in summary.arms.items()}
            for l_count in sorted({l_count for s in summary.arms.values() for l_count in s.branch_rate_by_l})[:3]},
    }


def write_study_figures(summary: StudySummary, profiles: Mapping[Arm, Sequence[GroupProfile]], out_dir: Path,
                        title: str) -> list[Path]:
    """``rollout_study.png`` (every quantity per arm with 95% CIs) and ``budget_split.png`` (m against
    H_root − H̄_tool for the arms that pre-monitor, i.e. where m varies), atomically."""
    from infra.plots import budget_scatter_figure, estimates_figure, save_png

    labels = [arm.label for arm in summary.arms]
    files = [save_png(estimates_figure(study_panels(summary), labels, title), out_dir / "rollout_study.png")]
    varying = {arm: ps for arm, ps in profiles.items() if len({p.global_budget for p in ps}) > 1}
    if varying:
        points = {arm.label: [(p.entropy_gap, float(p.global_budget)) for p in ps] for arm, ps in varying.items()}
        corr = {arm.label: summary.arms[arm].budget_correlation for arm in varying}
        files.append(save_png(budget_scatter_figure(points, corr, f"{title}: AEPO's budget split"),
                              out_dir / "budget_split.png"))
    return files


# ------------------------------------------------------------------------------------------------ a study's folder
def total_cost(costs: list[ArmCost]) -> ArmCost:
    return ArmCost(sum(c.wall_s for c in costs), sum(c.generate_s for c in costs), sum(c.tools_s for c in costs),
                   sum(c.tokens_generated for c in costs))


def study_metrics(summary: StudySummary, costs: dict[Arm, ArmCost]) -> dict[str, float]:
    """``study/k<k>/<mode>/<quantity>`` (means), ``…/branch_rate_l<l>``, ``…/wall_s`` and ``…/tokens_generated``, and
    ``study/k<k>/<a>-<b>/<quantity>`` (paired differences)."""
    out: dict[str, float] = {}
    for arm, s in summary.arms.items():
        out.update({f"study/{arm.label}/{q}": e.mean for q, e in s.estimates.items()})
        out[f"study/{arm.label}/budget_correlation"] = s.budget_correlation.mean
        out.update({f"study/{arm.label}/branch_rate_l{l_count}": e.mean for l_count, e in s.branch_rate_by_l.items()})
        if arm in costs:
            out[f"study/{arm.label}/wall_s"] = costs[arm].wall_s
            out[f"study/{arm.label}/tokens_generated"] = costs[arm].tokens_generated
    for (k, a, b), diffs in summary.diffs.items():
        out.update({f"study/k{k}/{a}-{b}/{q}": e.mean for q, e in diffs.items()})
    return out


def write_summary(path: Path, summary: StudySummary, costs: dict[Arm, ArmCost], meta: dict[str, Any]
                  ) -> dict[str, Any]:
    """summary.json (atomically): the study's settings, then :meth:`StudySummary.to_json`."""
    data = {**meta, **summary.to_json(costs)}
    with atomic_file(path, "w") as fh:
        json.dump(data, fh, indent=1)
    return data


def resumed_profiles(out_dir: Path, meta: dict[str, Any]
                     ) -> tuple[dict[Arm, list[GroupProfile]], dict[Arm, ArmCost], dict[str, Any]]:
    """What an earlier run of this study (same folder) sampled, when its settings are these: its profiles, costs
    and arms' rollout settings; empty when the study is new."""
    settings = out_dir / "study.json"
    if not settings.is_file():
        return {}, {}, {}
    old = json.loads(settings.read_text())
    for key in ("policy_digest", "numerics", "seed", "datasets", "chunk_questions", "engine"):
        if old.get(key) != meta[key]:
            raise ValueError(f"study {out_dir.name} exists with {key}={old.get(key)!r}, not {meta[key]!r}: resume it "
                             "with the same settings or choose another run name")
    profiles = read_profiles(out_dir / "profiles.parquet") if (out_dir / "profiles.parquet").is_file() else {}
    for arm in profiles:  # this run's arms must be sampled as before; an earlier run's other arms are kept
        if arm.label in meta["rollout"] and old["rollout"].get(arm.label) != meta["rollout"][arm.label]:
            raise ValueError(f"study {out_dir.name}: arm {arm.label} was sampled with other rollout settings")
    return profiles, read_costs(out_dir / "costs.json"), dict(old["rollout"])


def study_questions(runtime: PolicyRuntime, datasets: Sequence[str], max_questions: int) -> list[QuestionRow]:
    """The first ``max_questions`` distinct questions of the datasets, in order (ids repeated across datasets once;
    fewer when the datasets hold fewer)."""
    rows: list[QuestionRow] = []
    seen: set[str] = set()
    for spec in datasets:
        for row in runtime.load_rows(spec):
            if row.id not in seen:
                seen.add(row.id)
                rows.append(row)
    return rows[:max_questions]


@dataclass
class StudyFolder:
    """A study's folder, ``<runs_dir>/studies/<run name>/``, as it fills: ``meta`` (the settings of ``study.json``)
    and, per arm, the profiles and cost sampled so far (an earlier run's arms that this run does not sample
    included, kept as they are); ``done`` / ``done_costs``: what an earlier run of the study left."""

    out_dir: Path
    meta: dict[str, Any]
    done: dict[Arm, list[GroupProfile]]
    done_costs: dict[Arm, ArmCost]
    profiles: dict[Arm, list[GroupProfile]] = field(default_factory=dict)
    costs: dict[Arm, ArmCost] = field(default_factory=dict)

    @classmethod
    def open(cls, out_dir: Path, runtime: PolicyRuntime, policy: str, rows: Sequence[QuestionRow],
             datasets: Sequence[str], seed: int, rollouts: Mapping[Arm, RolloutConfig],
             chunk_questions: int) -> StudyFolder:
        """The study's settings (the policy and a digest of its weights, the numerics and the machine, the
        questions, seed, each arm's rollout section) checked against an earlier run's (:func:`resumed_profiles`: a
        mismatch fails before any run starts), then written to ``study.json``."""
        meta = {"policy": policy, "policy_digest": weights_digest(runtime.model),
                "numerics": runtime.numerics.params(), "cpu": runtime.numerics.tags(), "questions": len(rows),
                "datasets": list(datasets), "seed": seed, "engine": runtime.cfg.rollout.engine,
                "arms": [a.label for a in rollouts], "chunk_questions": chunk_questions,
                "rollout": {a.label: r.model_dump(exclude={"vllm", "remote"}) for a, r in rollouts.items()}}
        done, done_costs, earlier = resumed_profiles(out_dir, meta)
        with atomic_file(out_dir / "study.json", "w") as fh:
            json.dump({**meta, "rollout": {**earlier, **meta["rollout"]}}, fh, indent=1)
        return cls(out_dir, meta, done, done_costs)

    def resume(self, arms: Sequence[Arm], ids: Sequence[str], chunk_questions: int) -> dict[Arm, int]:
        """Take up what the earlier run sampled: its other arms as they are, and of ``arms`` the chunks it finished
        (which must be this study's first questions, ``ids``, in chunks of ``chunk_questions``); returns the
        questions each of ``arms`` has."""
        self.profiles.update({arm: ps for arm, ps in self.done.items() if arm not in arms})
        self.costs.update({arm: c for arm, c in self.done_costs.items() if arm not in arms})
        for arm in arms:
            kept = self.done.get(arm, [])
            if [p.question_id for p in kept] != list(ids[: len(kept)]) or (len(kept) % chunk_questions and
                                                                         len(kept) != len(ids)):
                raise ValueError(f"study {self.out_dir.name}: arm {arm.label} holds questions that are not this "
                                 f"study's first {len(kept)} in chunks of {chunk_questions}")
            self.profiles[arm], self.costs[arm] = list(kept), self.done_costs.get(arm, ArmCost(0.0, 0.0, 0.0, 0.0))
        return {arm: len(self.profiles[arm]) for arm in arms}

    def add(self, arm: Arm, profiles: Sequence[GroupProfile], cost: ArmCost) -> None:
        """One sampled chunk of ``arm``; ``profiles.parquet`` and ``costs.json`` rewritten (a stopped study keeps
        every chunk it finished, and what it cost)."""
        self.profiles[arm].extend(profiles)
        self.costs[arm] = total_cost([self.costs[arm], cost])
        write_profiles(self.out_dir / "profiles.parquet", self.profiles)
        write_costs(self.out_dir / "costs.json", self.costs)

    def summarize(self, n_resamples: int, seed: int, title: str
                  ) -> tuple[StudySummary, dict[str, Any], list[Path]]:
        """The summary with bootstrap CIs, ``summary.json``'s content (written) and the figures (written)."""
        summary = summarize_study(self.profiles, n_resamples, seed)
        data = write_summary(self.out_dir / "summary.json", summary, self.costs, self.meta)
        return summary, data, write_study_figures(summary, self.profiles, self.out_dir, title)
