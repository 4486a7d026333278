"""Where the policy's entropy lives (issue 53 §1), read from a sweep's stored trajectories: per arm and RL step, the
mean entropy of model tokens by class (template/tags, thoughts, tool queries, answers), of the root window and of the
post-tool windows ΔH reads, and the share of model tokens at or above 0.672 nats (:mod:`aepo_core.token_classes`).

Each response (a leaf) is tallied as the update sees it: its model tokens, a shared prefix once per leaf. Per run the
value at a step is over all its leaves there; per arm, the mean over seeds with a Student-t 95 % interval (what a new
run would give). Nothing is recomputed from the model: the entropies are the sampler's, as stored.

Run: ``.venv/bin/python -m bench.entropy_map --runs-dir bench/results/claims_powered/store --sweep claims-powered-bench
[--arms aepo arpo grpo] [--out bench/results/entropy_map_claims_powered.json] [--tokenizer DIR]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aepo_core.evaluation import OverSeeds
from aepo_core.token_classes import TOKEN_CLASSES, WINDOWS, EntropyTally, token_classes
from bench.harness import RESULTS_DIR, environment, print_table, write_result

REPORTED = (*(f"entropy_{c}" for c in (*TOKEN_CLASSES, *WINDOWS)), "entropy_model", "high_entropy_share",
            *(f"share_{c}" for c in TOKEN_CLASSES))


def run_tallies(store: Any, run_id: str, tokenizer: Any, window: int) -> dict[int, EntropyTally]:
    """Step → the tally of every leaf the run stored at that step."""
    out: dict[int, EntropyTally] = {}
    table = store.read_table("trajectories", run_id, None, None,
                             ["step", "response_tokens", "entropies", "loss_mask", "response_text"])
    for row in table.to_pylist():
        pieces = [tokenizer.decode([t]) for t in row["response_tokens"]]
        classes = token_classes(pieces, row["response_text"])
        tally = out.setdefault(int(row["step"]), EntropyTally())
        tally.add(classes, [math.nan if h is None else h for h in row["entropies"]], row["loss_mask"], window)
    return out


def over_seeds(values: dict[int, float]) -> dict[str, Any] | None:
    kept = {s: v for s, v in values.items() if not math.isnan(v)}
    return dataclasses.asdict(OverSeeds.of(kept)) if kept else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, required=True)
    p.add_argument("--sweep", required=True, help="The sweep's name, parent run id or file.")
    p.add_argument("--arms", nargs="+", default=None)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "entropy_map.json")
    p.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: each run's model.name; the SFT "
                   "start of a sweep from another machine is not in this one's cache: its base model's, the same "
                   "vocabulary)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from infra.run.compare import find_runs
    from infra.store import TrajectoryStore
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    runs = args.runs_dir.resolve()
    uri = tracking_uri_for(runs)
    selection = find_runs(uri, args.sweep, [], args.arms, None)
    client = Tracker(uri).client
    store = TrajectoryStore(runs)
    tokenizers: dict[str, Any] = {}
    per_run: dict[str, dict[int, dict[int, dict[str, float]]]] = {}  # arm → seed → step → metrics
    for run in selection.runs:
        params = client.get_run(run.run_id).data.params
        model = args.tokenizer or params["model.name"]
        tokenizer = tokenizers.get(model) or tokenizers.setdefault(model, AutoTokenizer.from_pretrained(model))
        tallies = run_tallies(store, run.run_id, tokenizer, int(params["rollout.entropy_window"]))
        per_run.setdefault(run.arm, {})[run.seed] = {step: t.metrics() for step, t in sorted(tallies.items())}
        print(f"{run.arm} seed {run.seed}: {len(tallies)} steps")
    arms: dict[str, Any] = {}
    for arm, seeds in per_run.items():
        first = {s: min(steps) for s, steps in seeds.items()}
        last = {s: max(steps) for s, steps in seeds.items()}
        arms[arm] = {when: {m: over_seeds({s: seeds[s][at[s]][m] for s in seeds}) for m in REPORTED}
                     for when, at in (("first_step", first), ("last_step", last))}
    for when in ("first_step", "last_step"):
        print_table(f"Entropy of model tokens by class, {when.replace('_', ' ')} (nats; mean [95% CI over seeds])",
                    ["arm", *(m.removeprefix("entropy_") for m in REPORTED)],
                    [[arm, *(_cell(a[when][m]) for m in REPORTED)] for arm, a in arms.items()])
    write_result(args.out, {"benchmark": "entropy_map", "environment": environment(threads=0), "sweep": args.sweep,
                            "runs_dir": str(runs), "arms": arms, "per_run": per_run})
    print(f"results: {args.out}")
    return 0


def _cell(value: dict[str, Any] | None) -> str:
    if value is None:
        return "–"
    low, high = value["low"], value["high"]
    return f"{value['mean']:.3f}" + ("" if low is None else f" [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    raise SystemExit(main())
