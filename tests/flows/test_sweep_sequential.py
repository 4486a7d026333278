"""``aepo sweep --sequential`` (issue 52 item 4): the sweep file's ``sequential:`` section, the waves it runs and the
looks it takes from the finished cells' per-question Pass@1 in MLflow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from aepo_core.config_keys import ConfigError
from aepo_core.sequential import Decision, run_looks
from flows.cli import app
from infra.run.sequential import SequentialBook, next_wave, outcome_lines, sequential_design
from infra.run.sweep_spec import SweepSpec, load_sweep

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
CELLS = {"aepo": {"algorithm.loss": "aepo"}, "arpo": {"algorithm.loss": "ppo_clip"},
         "grpo": {"rollout.mode": "independent"}}
SEQUENTIAL = {"waves": [2, 2, 2], "comparisons": [["aepo", "arpo"], ["aepo", "grpo"], ["arpo", "grpo"]],
              "margin": 0.1}


def _spec(**sequential: Any) -> SweepSpec:
    return load_sweep({"name": "seq", "base": TINY, "seeds": [0, 1, 2, 3, 4, 5], "cells": CELLS,
                       "sequential": {**SEQUENTIAL, **sequential}})


@pytest.mark.parametrize(("section", "field"), [
    ({"waves": [2, 2]}, "sequential.waves: [2, 2] add up to 4 seeds, but seeds lists 6"),
    ({"comparisons": [["aepo", "dapo"]]}, "sequential.comparisons: no cell(s) ['dapo']"),
    ({"alpha": "big"}, "sequential.alpha: Input should be a valid number"),
    ({"alpha": 1.5}, "sequential: alpha must be in (0, 1)"),
    ({"waves": [1, 5]}, "sequential: the first wave needs at least 2 seeds"),
    ({"variance": "robust"}, "sequential.variance: Input should be 'paired', 'pooled' or 'pilot'"),
    ({"spending": "pocock"}, "sequential.spending: Extra inputs are not permitted"),
    ({"futility": "always"}, "sequential.futility: Input should be 'none', 'obf' or 'pocock'"),
    ({"sigma": "wide"}, "sequential.sigma: Input should be a valid number"),
    ({"variance": "pilot", "delta": 0.121}, "sequential: sigma must be > 0 with variance: pilot"),
    ({"futility": "obf", "sigma": 0.0963}, "sequential: delta must be > 0 with futility: obf"),
    ({"variance": "pilot", "delta": 0.121, "sigma": 0.0963}, "sequential: waves [2, 2, 2] give 6 seeds; the pilot σ"),
    ({"power": 1.2}, "sequential: power must be in (0, 1)"),
])
def test_a_bad_section_names_its_field(section: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _spec(**section)
    assert field in str(exc.value)


def test_sequential_needs_a_section_and_no_shard() -> None:
    plain = load_sweep({"name": "plain", "base": TINY, "seeds": [0, 1], "cells": {"a": {}}})
    with pytest.raises(ConfigError, match="needs a `sequential:` section"):
        sequential_design(plain, None)
    with pytest.raises(ConfigError, match="drop --shard"):
        sequential_design(_spec(), "1/2")
    assert sequential_design(_spec(), None).waves == (2, 2, 2)
    assert _spec().as_dict()["sequential"]["margin"] == 0.1


def test_cli_refuses_in_one_line_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"name": "seq", "base": TINY, "seeds": [0, 1, 2], "cells": CELLS,
                                "sequential": {**SEQUENTIAL, "waves": [2, 2]}}))
    result = CliRunner().invoke(app, ["sweep", "-c", str(path), "--sequential", "--dry-run"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "sequential.waves" in result.stderr and "Traceback" not in result.stderr
    path.write_text(json.dumps({"name": "plain", "base": TINY, "seeds": [0, 1], "cells": {"a": {}}}))
    result = CliRunner().invoke(app, ["sweep", "-c", str(path), "--sequential", "--dry-run"])
    assert result.exit_code == 2 and "sequential:" in result.stderr


def _cell(value: float, seed: int) -> dict[str, float]:
    """A run's per-question Pass@1 with mean ``value`` (four questions, a seed-dependent spread)."""
    return {f"q{i}": value + (0.02 if (i + seed) % 2 else -0.02) for i in range(4)}


def test_waves_follow_the_looks_and_a_decided_arm_runs_no_more() -> None:
    spec = _spec()
    design = sequential_design(spec, None)
    finished: dict[str, dict[int, dict[str, float]]] = {}
    outcome = run_looks(design, finished, spec.seeds)
    assert [(r.cell, r.seed) for r in next_wave(spec, outcome, set())] == [
        (c, s) for c in ("aepo", "arpo", "grpo") for s in (0, 1)]
    means = {"aepo": [0.9, 0.92, 0.91, 0.93], "arpo": [0.30, 0.36, 0.31, 0.35], "grpo": [0.32, 0.31, 0.36, 0.33]}
    for cell, values in means.items():
        finished[cell] = {s: _cell(v, s) for s, v in enumerate(values)}
    done = {f"seq-{c}-s{s}" for c in means for s in range(4)}
    # a half-finished wave 3: only the missing cell runs, and look 3 waits for it
    outcome = run_looks(design, finished, spec.seeds)
    assert len(outcome.looks) == 2
    decided = outcome.decisions()
    assert decided[("aepo", "arpo")].decision is Decision.DIFFER  # +0.59 over 4 seeds: |t| ≫ the t_3 boundary
    assert decided[("aepo", "grpo")].decision is Decision.DIFFER
    assert decided[("arpo", "grpo")].decision is Decision.CONTINUE
    assert outcome.active_arms() == ("arpo", "grpo")
    wave = next_wave(spec, outcome, done | {"seq-arpo-s4", "seq-arpo-s5", "seq-grpo-s4"})
    assert [r.run_name for r in wave] == ["seq-grpo-s5"]  # aepo is dropped: no seq-aepo-s4/s5
    # the looks are a function of the finished cells alone: the same cells, read in another order, decide the same
    shuffled = {c: dict(reversed(list(finished[c].items()))) for c in reversed(list(finished))}
    assert run_looks(design, shuffled, spec.seeds) == outcome
    lines = outcome_lines(outcome)
    assert "Bonferroni over 3" in lines[0] and any(line.startswith("aepo - arpo: differ (>) at 4 seeds")
                                                   for line in lines)


def _log_child(client: Any, experiment_id: str, parent: str, name: str, per_question: dict[str, float]) -> None:
    run = client.create_run(experiment_id, run_name=name, tags={"mlflow.parentRunId": parent})
    run_id = run.info.run_id
    client.log_metric(run_id, "eval/synthetic_test/pass_at_1", sum(per_question.values()) / len(per_question))
    rows = [{"question_id": q, "n": 2, "correct": round(2 * v)} for q, v in per_question.items()]
    client.log_text(run_id, json.dumps({"questions": rows}), "eval/final/synthetic_test.json")
    client.set_terminated(run_id, "FINISHED")


def test_the_looks_read_the_finished_cells_from_mlflow(tmp_path: Path) -> None:
    """Stored cells (a parent run's FINISHED children with their eval/final/<dataset>.json) → the looks and the next
    wave, and every look recorded as the parent's sequential.json."""
    from infra.run.sweep import Launch, SweepBook

    spec = _spec(waves=[2, 4], comparisons=[["aepo", "arpo"]], margin=None)
    book = SweepBook.open(spec, tmp_path)
    client, parent = book.tracker.client, book.tracker.start(spec.base, run_name="seq", group=True)
    experiment_id = book.tracker.experiment_id()
    launch = Launch(parent, None, {}, "here", "float32", tmp_path / "out")
    answers = {"aepo": [1.0, 1.0, 1.0, 0.5], "arpo": [0.0, 0.5, 0.0, 0.0]}
    for cell, values in answers.items():
        for seed in (0, 1):  # seed 1 answers one question differently: a spread to estimate
            _log_child(client, experiment_id, parent, f"seq-{cell}-s{seed}",
                       {f"q{i}": (v if seed == 0 or i else 1.0 - v) for i, v in enumerate(values)})
    seq = SequentialBook(book, sequential_design(spec, None))
    outcome, wave = seq.look(launch)
    (look,) = outcome.looks
    (c,) = look.comparisons
    assert c.seeds == 2 and c.df == 1 and c.decision is Decision.CONTINUE
    assert c.estimate == pytest.approx(((0.875 - 0.125) + (0.625 - 0.375)) / 2)  # q0 flipped at seed 1
    assert sorted(r.run_name for r in wave) == [f"seq-{a}-s{s}" for a in ("aepo", "arpo") for s in (2, 3, 4, 5)]
    path = seq.record(launch, outcome)
    assert json.loads(path.read_text())["looks"][0]["comparisons"][0]["decision"] == "continue"
    logged = client.get_run(parent).data.params
    assert logged["sequential.waves"] == "[2, 4]" and logged["sequential.variance"] == "paired"
    assert logged["sequential.futility"] == "none" and logged["sequential.power"] == "0.8"
    book.tracker.finish()


def test_a_pilot_design_with_futility_flows_from_the_file() -> None:
    spec = load_sweep({"name": "seq", "base": TINY, "seeds": list(range(8)), "cells": CELLS,
                       "sequential": {**SEQUENTIAL, "waves": [2, 2, 2, 2], "variance": "pilot", "futility": "obf",
                                      "delta": 0.121, "sigma": 0.0963}})
    design = sequential_design(spec, None)
    assert (design.variance, design.futility, design.sigma, design.power) == ("pilot", "obf", 0.0963, 0.8)
    assert spec.as_dict()["sequential"]["futility"] == "obf" and "futility" in design.describe()
    # aepo ≫ both others; arpo = grpo to the third decimal: the futility rule ends arpo − grpo at look 1
    finished = {c: {s: {"q": v + 0.001 * s} for s in (0, 1)} for c, v in (("aepo", 0.9), ("arpo", 0.3),
                                                                          ("grpo", 0.3005))}
    outcome = run_looks(design, finished, spec.seeds)
    decided = outcome.decisions()
    assert decided[("arpo", "grpo")].decision is Decision.FUTILE
    assert decided[("aepo", "arpo")].decision is Decision.DIFFER and outcome.stopped
    assert next_wave(spec, outcome, set()) == []
    assert any("|z|" in line and "futile" in line for line in outcome_lines(outcome))


@pytest.mark.slow  # trains 4 tiny runs
def test_a_sequential_sweep_runs_wave_by_wave_stops_and_resumes_deciding_the_same(prefect_harness: Any,
                                                                                   tmp_path: Path) -> None:
    """End to end through the Prefect flow: the tiny policy scores 0 on every question, so after the first wave
    (seeds 0 and 1) both arms' paired difference is exactly 0 and its interval lies within the margin: EQUIVALENT,
    the sweep stops, seeds 2 and 3 never run. Continued with --resume it runs nothing and decides the same."""
    import yaml

    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    body = yaml.safe_load((REPO / "configs" / "sweeps" / "tiny.yaml").read_text())
    body.update(base=str(REPO / "configs" / "tiny.yaml"), seeds=[0, 1, 2, 3],
                sequential={"waves": [2, 2], "comparisons": [["aepo", "grpo"]], "margin": 0.1})
    path = tmp_path / "seq.yaml"
    path.write_text(yaml.safe_dump(body))
    result = sweep(sweep_config=str(path), runs_dir=str(tmp_path / "runs"), sequential=True)
    assert sorted(result.started) == ["tiny-sweep-aepo-s0", "tiny-sweep-aepo-s1", "tiny-sweep-grpo-s0",
                                  "tiny-sweep-grpo-s1"]
    assert any("aepo - grpo: equivalent" in line for line in result.sequential), result.sequential
    children = Tracker(result.tracking_uri).search_runs(
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert len(children) == 4 and set(children["status"]) == {"FINISHED"}

    again = sweep(sweep_config=str(path), runs_dir=str(tmp_path / "runs"), sequential=True, resume=True)
    assert again.started == [] and again.parent_run_id == result.parent_run_id
    assert again.sequential == result.sequential
