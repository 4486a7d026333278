"""The rollout study's per-question table on disk (Parquet) and its summary (JSON-ready), see :mod:`flows.study`.

One row per (k, sampling mode, question): the :class:`~aepo_core.rollout.study.GroupProfile` of that question's
rollout group, plus the cost of the chunk it was sampled in. The summary is recomputed from this table alone, so
``--analyse-only`` re-analyses a study without sampling again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from aepo_core.rollout.rows import null_nan
from aepo_core.rollout.study import (
    QUANTITIES,
    Estimate,
    GroupProfile,
    ModeSummary,
    paired_difference,
    summarize_mode,
)
from infra.atomic import atomic_file

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
    ],
    metadata={"doc": "aepo rollout study: one row per (k, mode, question), see aepo_core/rollout/study.py"},
)

PROFILE_FIELDS = tuple(f.name for f in fields(GroupProfile))


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
         **{name: (list(v) if name == "consecutive" else null_nan(v) if isinstance(v, float) else v)
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
    for row in pq.read_table(path, schema=PROFILE_SCHEMA).to_pylist():
        values = {name: row[name] for name in PROFILE_FIELDS}
        for name in ("top1_share", "top3_share", "entropy_gap"):
            values[name] = math.nan if values[name] is None else values[name]
        values["consecutive"] = tuple(values["consecutive"])
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


# Paired comparisons reported per k: (a, b) means a − b on the same questions.
PAIRS: tuple[tuple[str, str], ...] = (("aepo", "arpo"), ("aepo", "independent"), ("arpo", "independent"))


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
                               "cost": _cost_json(costs[arm]) if costs and arm in costs else None}
        paired = {f"k{k}/{a}-{b}": {q: est(e) for q, e in d.items()} for (k, a, b), d in self.diffs.items()}
        return {"arms": arms, "paired": paired}


def summarize_study(profiles: Mapping[Arm, Sequence[GroupProfile]], n_resamples: int = 1000,
                    seed: int = 0) -> StudySummary:
    """Per arm: :func:`summarize_mode`; per k and pair of modes present: the paired difference of every quantity."""
    arms = {arm: summarize_mode(ps, n_resamples, seed) for arm, ps in profiles.items()}
    diffs: dict[tuple[int, str, str], dict[str, Estimate]] = {}
    for k in sorted({arm.k for arm in profiles}):
        for a, b in PAIRS:
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
    }


def write_study_figures(summary: StudySummary, profiles: Mapping[Arm, Sequence[GroupProfile]], out_dir: Path,
                        title: str) -> list[Path]:
    """``rollout_study.png`` (every quantity per arm with 95% CIs) and ``budget_split.png`` (m against
    H_root − H̄_tool for the arms that pre-monitor, i.e. where m varies), atomically."""
    from infra.plots import budget_scatter_figure, rollout_study_figure, save_png

    labels = [arm.label for arm in summary.arms]
    files = [save_png(rollout_study_figure(study_panels(summary), labels, title), out_dir / "rollout_study.png")]
    varying = {arm: ps for arm, ps in profiles.items() if len({p.global_budget for p in ps}) > 1}
    if varying:
        points = {arm.label: [(p.entropy_gap, float(p.global_budget)) for p in ps] for arm, ps in varying.items()}
        corr = {arm.label: summary.arms[arm].budget_correlation for arm in varying}
        files.append(save_png(budget_scatter_figure(points, corr, f"{title}: AEPO's budget split"),
                              out_dir / "budget_split.png"))
    return files
