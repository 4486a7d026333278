"""Does a candidate testbed give AEPO's mechanisms something to act on (issue 53 §3)? Its figures against the targets.

Reads the finished runs of a sweep (any: ``bench/demo_seeds.py --name …`` with ``--set`` overrides, or ``aepo
sweep``), one cell per candidate, and reports per candidate, over its seeds (mean and Student-t 95 % interval, what a
new run would give; one seed: no interval):

- at the RL start (the first RL step's rollout): the mean entropy of model tokens and of the post-tool windows that ΔH
  reads, the share of model tokens at or above 0.672 nats, the entropy of each token class;
- over training (each run's mean over its RL steps): the mechanism activity every step logs
  (:data:`aepo_core.activity.ACTIVITY_METRICS`) and the share of high-entropy update tokens clipped, both sides;
- the positive control "RL against no RL": each run's final Pass@1 − its Pass@1 after SFT on the same questions
  (the runs need ``eval.at_start: true``), over seeds and pooled over questions (:mod:`bench.demo_seeds`).

A target is **met** where the interval lies above it, **not met** where below, **undecided** where it holds it, and
read from the mean alone with one seed. Nothing is re-run; the entropies are the sampler's, as logged.

Run: ``.venv/bin/python -m bench.testbed --runs-dir runs/testbed --sweep s9-cand2 [--arms base]
[--out bench/results/testbed.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aepo_core.activity import ACTIVITY_METRICS
from aepo_core.evaluation import OverSeeds
from aepo_core.token_classes import TOKEN_CLASSES
from bench.harness import RESULTS_DIR, environment, print_table, write_result
from flows.cli.render import interval

HOT_CLIPPED = "train/high_entropy_clip_frac"
"""Per step, the share of update tokens at or above 0.672 nats that the loss clipped, high and low sides summed."""
AT_START = ("rollout/entropy_model", "rollout/entropy_post_tool_window", "rollout/entropy_root_window",
            "rollout/high_entropy_share", "rollout/delta_h_mean",
            *(f"rollout/entropy_{c}" for c in TOKEN_CLASSES))


@dataclass(frozen=True)
class Target:
    """Issue 53 §3's targets: ``metric`` (at the RL start, or its mean over training) at least ``floor``."""

    label: str
    metric: str
    when: str  # "start" | "training"
    floor: float

    def verdict(self, o: OverSeeds | None) -> str:
        if o is None:
            return "not logged"
        if o.low is None or o.high is None:
            return ("met" if o.mean >= self.floor else "not met") + " (one seed)"
        return "met" if o.low >= self.floor else "not met" if o.high < self.floor else "undecided"


TARGETS = (
    Target("model tokens ≥ 0.2 nats at the RL start", "rollout/entropy_model", "start", 0.2),
    Target("post-tool windows ≥ 0.5 nats at the RL start", "rollout/entropy_post_tool_window", "start", 0.5),
    Target("≥ 2 % of high-entropy update tokens clipped", HOT_CLIPPED, "training", 0.02),
)


def run_histories(tracker: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """The run's per-step histories of what the testbed reads; the two clipped sides summed into :data:`HOT_CLIPPED`."""
    sides = [f"{HOT_CLIPPED}_high", f"{HOT_CLIPPED}_low"]
    hist = tracker.metric_history(list(dict.fromkeys([*AT_START, *ACTIVITY_METRICS, *sides])), run_id=run_id)
    high, low = (dict(hist[s]) for s in sides)
    hist[HOT_CLIPPED] = [(step, v + low[step]) for step, v in sorted(high.items()) if step in low]
    return hist


def first_step(hist: Sequence[tuple[int, float]]) -> float | None:
    return hist[0][1] if hist else None


def mean_over_steps(hist: Sequence[tuple[int, float]]) -> float | None:
    values = [v for _, v in hist if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def over_seeds(values: Mapping[int, float | None]) -> OverSeeds | None:
    kept = {s: v for s, v in values.items() if v is not None and not math.isnan(v)}
    return OverSeeds.of(kept) if kept else None


def candidate(hists: Mapping[int, Mapping[str, Sequence[tuple[int, float]]]]) -> dict[str, dict[str, OverSeeds]]:
    """Seed → histories of one candidate's runs → ``{"start": {metric: …}, "training": {metric: …}}`` over seeds."""
    start = {m: o for m in AT_START if (o := over_seeds({s: first_step(h.get(m, [])) for s, h in hists.items()}))}
    training = {m: o for m in (*ACTIVITY_METRICS, HOT_CLIPPED)
                if (o := over_seeds({s: mean_over_steps(h.get(m, [])) for s, h in hists.items()}))}
    return {"start": start, "training": training}


def _cell(o: OverSeeds | None, percent: bool = False) -> str:
    if o is None:
        return "–"
    scale = 100 if percent else 1
    return interval(o.mean * scale, None if o.low is None else o.low * scale,
                    None if o.high is None else o.high * scale, digits=1 if percent else 3)


def measure(tracker: Any, runs: Sequence[Any], arm: str, workdir: Path) -> dict[str, Any]:
    """One candidate's figures from its runs (:class:`infra.run.compare.ComparedRun`, one per seed)."""
    from bench.demo_seeds import cell_summary, read_run

    figures = candidate({r.seed: run_histories(tracker, r.run_id) for r in runs})
    dataset = next(k.split("/")[1] for k in tracker.client.get_run(runs[0].run_id).data.metrics
                   if k.startswith("eval/") and k.endswith("/pass_at_1"))
    records = [read_run(tracker, {"run_id": r.run_id, "cell": arm, "seed": r.seed, "run_name": r.run_name},
                        dataset, workdir) for r in runs]
    return {"seeds": [r.seed for r in runs], "runs": [r.run_id for r in runs], "dataset": dataset,
            "figures": figures, "rl_gain": cell_summary(records, 1000)}


def report(arm: str, c: Mapping[str, Any]) -> None:
    figures, control = c["figures"], c["rl_gain"]
    print_table(f"Candidate {arm}: issue 53's targets ({len(c['seeds'])} seed(s); mean [95% CI over seeds])",
                ["target", "figure", "verdict"],
                [[t.label, _cell(figures[t.when].get(t.metric), percent=t.metric == HOT_CLIPPED),
                  t.verdict(figures[t.when].get(t.metric))] for t in TARGETS])
    print_table(f"Candidate {arm}: at the RL start (nats; shares in %)", ["metric", "value"],
                [[m, _cell(o, percent="share" in m)] for m, o in figures["start"].items()])
    print_table(f"Candidate {arm}: mechanism activity, mean over RL steps", ["metric", "value"],
                [[ACTIVITY_METRICS.get(m, m), _cell(o)] for m, o in figures["training"].items()])
    seeds, pooled = control["gain_over_seeds"], control["pooled_gain"]
    print(f"RL against no RL (final − SFT Pass@1 on {c['dataset']}): over seeds "
          f"{interval(seeds['mean'], seeds['low'], seeds['high'], signed=True)}, pooled over questions "
          f"{interval(pooled['diff'], pooled['ci_low'], pooled['ci_high'], signed=True)}; "
          f"{control['positive_seeds']}/{len(c['seeds'])} seeds gained")


def as_json(c: Mapping[str, Any]) -> dict[str, Any]:
    figures = c["figures"]
    return {**{k: v for k, v in c.items() if k != "figures"},
            "targets": {t.label: {"verdict": t.verdict(o := figures[t.when].get(t.metric)), "figure": _asdict(o)}
                        for t in TARGETS},
            **{when: {m: dataclasses.asdict(o) for m, o in figures[when].items()} for when in ("start", "training")}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, required=True)
    p.add_argument("--sweep", required=True, help="The sweep's name, parent run id or file.")
    p.add_argument("--arms", nargs="+", default=None, help="Its cells (candidates) to report (default: all).")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "testbed.json")
    args = p.parse_args(argv)
    from infra.run.compare import find_runs
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    uri = tracking_uri_for(args.runs_dir.resolve())
    selection = find_runs(uri, args.sweep, [], args.arms, None)
    tracker = Tracker(uri)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in selection.arms:
            c = measure(tracker, [r for r in selection.runs if r.arm == arm], arm, Path(tmp))
            report(arm, c)
            out[arm] = as_json(c)
    write_result(args.out, {"benchmark": "testbed (issue 53 §3)", "environment": environment(threads=0),
                            "sweep": args.sweep, "runs_dir": str(args.runs_dir), "candidates": out})
    print(f"results: {args.out}")
    return 0


def _asdict(o: OverSeeds | None) -> dict[str, Any] | None:
    return None if o is None else dataclasses.asdict(o)


if __name__ == "__main__":
    raise SystemExit(main())
