"""A sequential sweep's bookkeeping (``aepo sweep --sequential``, :mod:`aepo_core.sequential` decides): the final
per-question Pass@1 of the sweep's finished cells, the looks they allow, the cells of the next wave, and the record of
every look in the parent MLflow run (``sequential.*`` params, a ``sequential.json`` artifact and file).

The looks are recomputed from the finished children of the parent run every time (:func:`aepo_core.sequential.
run_looks`): a sweep killed and continued with ``--resume`` takes the same looks and runs the same cells.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aepo_core.config_keys import ConfigError
from aepo_core.metrics import pass_at_k
from aepo_core.sequential import Decision, Design, SequentialOutcome, run_looks
from infra.atomic import atomic_file
from infra.run.sweep import Launch, SweepBook
from infra.run.sweep_spec import SweepRun, SweepSpec
from infra.tracking.client import download_artifacts

FINAL_STAGE = "final"


@dataclass(frozen=True)
class QuestionOutcomeRow:
    """One question of a run's final evaluation file (``eval/final/<dataset>.json``): its samples and correct ones."""

    question_id: str
    n: int
    correct: int
    family: str | None = None


def final_questions(tracking_uri: str, run_id: str, dataset: str, workdir: Path,
                    stage: str = FINAL_STAGE) -> list[QuestionOutcomeRow]:
    """The per-question outcomes of run ``run_id``'s evaluation at ``stage`` (default: the final one) on ``dataset``
    (its key), downloaded from its artifacts into ``workdir`` (what ``bench.compare_algorithms``, the sequential
    sweep and ``bench.int8_sampler`` read)."""
    path = download_artifacts(tracking_uri, f"runs:/{run_id}/eval/{stage}/{dataset}.json",
                              workdir / run_id / stage)
    rows = json.loads(Path(path).read_text())["questions"]
    return [QuestionOutcomeRow(str(r["question_id"]), int(r["n"]), int(r["correct"]),
                               str(r["family"]) if "family" in r else None) for r in rows]


def sequential_design(spec: SweepSpec, shard: str | None) -> Design:
    """The design ``--sequential`` runs: the sweep file's ``sequential:`` section (:class:`ConfigError` without one,
    or with a shard: a look needs every arm's cells)."""
    if spec.sequential is None:
        raise ConfigError(f"sweep {spec.name}: --sequential needs a `sequential:` section in the sweep file (waves, "
                          "comparisons: see infra/run/sweep_spec.py)")
    if shard is not None:
        raise ConfigError(f"sweep {spec.name}: --sequential runs every arm's waves itself: drop --shard")
    return spec.sequential.design()


def next_wave(spec: SweepSpec, outcome: SequentialOutcome, finished: set[str]) -> list[SweepRun]:
    """The runs to start now: the cells of the first wave without a look, for the arms still running, less those
    finished; none once the design has stopped."""
    design = outcome.design
    if outcome.stopped:
        return []
    start = sum(design.waves[:len(outcome.looks)])
    seeds = set(spec.seeds[start:start + design.waves[len(outcome.looks)]])
    arms = set(outcome.active_arms())
    return [r for r in spec.runs if r.cell in arms and r.seed in seeds and r.run_name not in finished]


@dataclass
class SequentialBook:
    """The looks of one sequential sweep invocation over its parent run's finished children (their per-question
    Pass@1 read once each)."""

    book: SweepBook
    design: Design
    datasets: list[str] | None = None
    _read: dict[str, dict[str, float]] = field(default_factory=dict)

    def finished(self, launch: Launch) -> dict[str, SweepRun]:
        """Run name → run of the parent's FINISHED children that this sweep plans."""
        by_name = {r.run_name: r for r in self.book.spec.runs}
        found = self.book.tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{launch.parent}' AND "
                                                            "attributes.status = 'FINISHED'")
        out: dict[str, SweepRun] = {}
        for _, row in found.iterrows():
            name = str(row["run_name"])
            if name in by_name and name not in out:
                out[name] = by_name[name]
                if name not in self._read:
                    self._read[name] = self._pass1(str(row["run_id"]), _datasets(row.to_dict(), self.datasets))
        return out

    def _pass1(self, run_id: str, datasets: Sequence[str]) -> dict[str, float]:
        """``<dataset>/<question>`` → the run's final Pass@1 on it (c/n over its samples)."""
        with tempfile.TemporaryDirectory(prefix="aepo-seq-") as tmp:
            return {f"{ds}/{q.question_id}": pass_at_k(q.n, q.correct, 1) for ds in datasets
                    for q in final_questions(self.book.tracking_uri, run_id, ds, Path(tmp))}

    def look(self, launch: Launch) -> tuple[SequentialOutcome, list[SweepRun]]:
        """The looks the finished cells allow and the runs of the next wave (none: stopped)."""
        finished = self.finished(launch)
        per_question: dict[str, dict[int, dict[str, float]]] = {}
        for name, run in finished.items():
            per_question.setdefault(run.cell, {})[run.seed] = self._read[name]
        outcome = run_looks(self.design, per_question, self.book.spec.seeds)
        return outcome, next_wave(self.book.spec, outcome, set(finished))

    def record(self, launch: Launch, outcome: SequentialOutcome) -> Path:
        """The design as params of the parent run, every look as its ``sequential.json`` (artifact and file in the
        launch's out_dir); returns the file."""
        d = self.design
        self.book.tracker.log_params({"sequential.waves": list(d.waves), "sequential.alpha": d.alpha,
                                      "sequential.margin": d.margin, "sequential.variance": d.variance,
                                      "sequential.comparisons": [f"{a} - {b}" for a, b in d.comparisons],
                                      "sequential.spending": "Lan-DeMets O'Brien-Fleming, Bonferroni",
                                      "sequential.futility": d.futility, "sequential.delta": d.delta,
                                      "sequential.sigma": d.sigma, "sequential.power": d.power})
        data = outcome.as_dict()
        self.book.tracker.log_dict(data, "sequential.json")
        path = launch.out_dir / "sequential.json"
        with atomic_file(path, "w") as fh:
            json.dump(data, fh, indent=1)
        return path


def _datasets(row: Mapping[str, object], only: Sequence[str] | None) -> list[str]:
    """The eval datasets a finished child reports (``metrics.eval/<key>/pass_at_1``), or ``only`` of them."""
    found = sorted(k.removeprefix("metrics.eval/").removesuffix("/pass_at_1") for k, v in row.items()
                   if k.startswith("metrics.eval/") and k.endswith("/pass_at_1") and v == v and v is not None)
    if only is None:
        return found
    missing = [d for d in only if d not in found]
    if missing:
        raise ConfigError(f"sequential.datasets: {missing} not evaluated by the cells (they report {found})")
    return list(only)


def outcome_lines(outcome: SequentialOutcome) -> list[str]:
    """The final table's lines: the design, then each comparison's deciding look."""
    lines = [outcome.design.describe(),
             f"error rates: family-wise two-sided α ≤ {outcome.design.alpha:g} (Bonferroni; "
             + ("z with the pilot's σ: holds when the true σ is the pilot's" if outcome.design.variance == "pilot"
                else "each look at the t boundary of the z boundary's nominal level")
             + "), simulated in bench/results/sequential*.json (bench/README.md, 'Sequential designs')"]
    for (a, b), c in outcome.decisions().items():
        if c is None:
            lines.append(f"{a} - {b}: no look yet")
            continue
        verdict = f"differ ({'>' if c.estimate > 0 else '<'})" if c.decision is Decision.DIFFER else c.decision.value
        stat = "|z|" if c.df is None else "|t|"
        futile = f", futility {c.futility_boundary:.2f}" if c.futility_boundary > 0 else ""
        lines.append(f"{a} - {b}: {verdict} at {c.seeds} seeds: {c.estimate:+.4f} (RCI {c.low:+.4f}, {c.high:+.4f}; "
                     f"{stat} {abs(c.statistic):.2f} vs {c.boundary:.2f}{futile}"
                     f"{'' if c.df is None else f', df {c.df}'})")
    return lines
