"""bench.compare_algorithms' training curves per arm, read back from a real MLflow store (SQLite in tmp_path) whose
child runs are named like a sweep's and carry metric histories logged here: the --analyse-only path (stored runs →
analysis → figures), seed bands, metrics missing from older runs, the entropy trend, the curves against the tokens
spent, the statistics over seeds and the seed-matched paired differences, the parent run's artifacts."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from aepo_core.evaluation import OverSeeds
from bench.compare_algorithms import (
    CLIP,
    CURVES_ARTIFACT_DIR,
    ENTROPY,
    TOKENS,
    _percent,
    analyse,
    by_tokens,
    curve_figures,
    entropy_trend,
    log_to_parent,
    ols_slope,
    paired_differences,
    report,
    stored_runs,
    sweep_spec,
)
from infra.tracking.client import artifact_location_for, tracking_uri_for
from infra.tracking.run import Tracker

REPO = Path(__file__).resolve().parents[2]
TOP1 = "rollout/branch_top1_share"
DATASET = "synthetic_test"

# run name → metric → [(step, value)]: aepo seed 1 is an "old" run without the branch shares; grpo seed 1 stopped
# after 2 steps; grpo never branches.
HISTORIES = {
    "tiny-sweep-aepo-s0": {ENTROPY: [(1, 1.0), (2, 0.9), (3, 0.8)], TOP1: [(1, 0.5), (2, 0.6), (3, 0.7)],
                           "rollout/reward_mean": [(1, -0.5), (2, 0.0), (3, 0.5)],
                           TOKENS: [(1, 100.0), (2, 250.0), (3, 400.0)],
                           "time/sft_s": [(0, 60.0)], "time/eval_sft_s": [(0, 30.0)], "time/eval_final_s": [(3, 30.0)],
                           "time/rollout_s": [(1, 8.0), (2, 8.0), (3, 8.0)],
                           "time/update_s": [(1, 10.0), (2, 10.0), (3, 10.0)],
                           "train/scoring_pass_s": [(1, 2.0), (2, 2.0), (3, 2.0)],
                           CLIP: [(1, 0.0), (2, 0.01), (3, 0.02)]},
    "tiny-sweep-aepo-s1": {ENTROPY: [(1, 1.2), (2, 1.1), (3, 1.0)], "rollout/reward_mean": [(1, 0.0), (3, 0.5)],
                           TOKENS: [(1, 120.0), (2, 250.0), (3, 380.0)],
                           # wall seconds by phase (grpo's runs are older than these timings)
                           "time/sft_s": [(0, 120.0)], "time/eval_sft_s": [(0, 30.0)], "time/eval_final_s": [(3, 50.0)],
                           "time/rollout_s": [(1, 10.0), (2, 12.0), (3, 14.0)],
                           "time/update_s": [(1, 20.0), (2, 25.0), (3, 30.0)],
                           "train/scoring_pass_s": [(1, 4.0), (2, 5.0), (3, 6.0)],
                           CLIP: [(1, 0.0), (2, 0.03), (3, 0.03)]},
    "tiny-sweep-grpo-s0": {ENTROPY: [(1, 1.0), (2, 0.4), (3, 0.2)], "rollout/reward_mean": [(1, 0.0)]},
    "tiny-sweep-grpo-s1": {ENTROPY: [(1, 1.0), (2, 0.5)]},
}
FAMILY = ["single_hop", "single_hop", "two_hop", "two_hop"]
CORRECT = {"tiny-sweep-aepo-s0": [2, 1, 0, 2], "tiny-sweep-aepo-s1": [2, 2, 0, 1],
           "tiny-sweep-grpo-s0": [1, 1, 0, 2], "tiny-sweep-grpo-s1": [2, 0, 0, 2]}


def make_store(runs: Path) -> tuple[str, str]:
    """The sweep's four children (FINISHED, with their histories and final evaluation) and a parent run, in the
    runs dir's SQLite store; (tracking URI, parent run id)."""
    uri = tracking_uri_for(runs)
    tracker = Tracker(uri, artifact_location=artifact_location_for(runs))
    client, exp = tracker.client, tracker.experiment_id()
    parent = client.create_run(exp, run_name="tiny-sweep").info.run_id
    for name, history in HISTORIES.items():
        rid = client.create_run(exp, run_name=name, tags={"mlflow.parentRunId": parent}).info.run_id
        for metric, points in history.items():
            for step, value in points:
                client.log_metric(rid, metric, value, step=step)
        correct = CORRECT[name]
        client.log_metric(rid, f"eval/{DATASET}/pass_at_1", sum(correct) / 8, step=3)
        client.log_metric(rid, f"eval/{DATASET}/tool_calls_per_question", 1.0, step=3)
        client.log_dict(rid, {"questions": [{"question_id": f"q{i}", "n": 2, "correct": c, "family": FAMILY[i]}
                                            for i, c in enumerate(correct)]}, f"eval/final/{DATASET}.json")
        client.set_terminated(rid)
    return uri, parent


def bands(expected: list[tuple[float, ...]]) -> list[object]:
    """``expected`` for ``==`` up to float rounding, band by band."""
    return [pytest.approx(b) for b in expected]


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    from infra.run.sweep_spec import load_sweep

    runs = tmp_path_factory.mktemp("runs")
    uri, parent = make_store(runs)
    checked = load_sweep(sweep_spec(REPO / "configs" / "sweeps" / "tiny.yaml", [], [0, 1], None, None))
    result = stored_runs(runs, checked, None)  # what --analyse-only reads
    assert result["tracking_uri"] == uri and len(result["runs"]) == 4
    with tempfile.TemporaryDirectory() as tmp:
        arms = analyse(result, DATASET, 2, 200, Path(tmp))
    return arms, uri, parent


def test_curves_are_seed_means_with_min_max_bands(analysed: tuple[dict, str, str]) -> None:
    arms, _, _ = analysed
    aepo, grpo = arms["aepo"]["curves"], arms["grpo"]["curves"]
    assert aepo[ENTROPY] == bands([(1, 1.1, 1.0, 1.2), (2, 1.0, 0.9, 1.1), (3, 0.9, 0.8, 1.0)])
    # a step one seed did not reach averages the seeds that did
    assert grpo[ENTROPY] == bands([(1, 1.0, 1.0, 1.0), (2, 0.45, 0.4, 0.5), (3, 0.2, 0.2, 0.2)])
    assert aepo["rollout/reward_mean"] == bands([(1, -0.25, -0.5, 0.0), (2, 0.0, 0.0, 0.0),
                                                         (3, 0.5, 0.5, 0.5)])
    # the branch share only the new aepo run logged: its band is that run alone; grpo (never logged) has none
    assert aepo[TOP1] == bands([(1, 0.5, 0.5, 0.5), (2, 0.6, 0.6, 0.6), (3, 0.7, 0.7, 0.7)])
    assert TOP1 not in grpo and "rollout/tool_calls_mean" not in aepo
    # the rest of the analysis still comes from the same runs
    assert arms["aepo"]["pass@1_by_seed"] == {0: pytest.approx(5 / 8), 1: pytest.approx(5 / 8)}
    assert arms["aepo"]["per_question_pass@1_by_seed"] == {0: {"q0": 1.0, "q1": 0.5, "q2": 0.0, "q3": 1.0},
                                                          1: {"q0": 1.0, "q1": 1.0, "q2": 0.0, "q3": 0.5}}
    assert arms["grpo"]["train_reward_last_step"] == pytest.approx(0.0)


def test_entropy_is_judged_by_the_runs_slopes_over_seeds(analysed: tuple[dict, str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The seed-mean curve is described (first, last, slope); rising or falling is the sign of the runs' slopes
    over seeds where their interval excludes 0. No last/first ratio: it rests on two steps, and a rise from a
    near-zero start (0.04 → 0.10 nats after SFT) read as "exploded"."""
    arms, _, _ = analysed
    report(arms, 2, DATASET)
    table = capsys.readouterr().out
    assert "Over training" in table and "falling" in table and "none shown" in table  # aepo falling, grpo not shown
    assert "exploded" not in table and "collapsed" not in table
    aepo = arms["aepo"]["entropy_trend"]
    assert aepo == {"first": pytest.approx(1.1), "last": pytest.approx(0.9), "slope": pytest.approx(-0.1)}
    assert entropy_trend([(1, 1.0, 1.0, 1.0)]) is None  # one step: no trend
    rise = entropy_trend([(1, 0.04, 0.04, 0.04), (2, 0.07, 0.07, 0.07), (3, 0.10, 0.10, 0.10)])
    assert rise is not None and rise.slope == pytest.approx(0.03) and (rise.first, rise.last) == (0.04, 0.10)


def test_figures_written_and_logged_to_the_parent(analysed: tuple[dict, str, str], tmp_path: Path) -> None:
    arms, uri, parent = analysed
    out = tmp_path / "claims"
    written = curve_figures(arms, out, "tiny-sweep")
    assert [p.name for p in written] == ["entropy_over_training.png", "training_curves.png", "curves_by_tokens.png"]
    for path in written:
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size[0] > 300
    names = ["curves_by_tokens.png", "entropy_over_training.png", "training_curves.png"]
    assert sorted(p.name for p in out.iterdir()) == names
    log_to_parent(uri, parent, written)
    logged = Tracker(uri).client.list_artifacts(parent, CURVES_ARTIFACT_DIR)
    assert sorted(Path(f.path).name for f in logged) == names
    # no curves at all (runs from before any of these metrics): no figure, no error
    bare = {name: {**a, "curves": {}} for name, a in arms.items()}
    assert curve_figures(bare, tmp_path / "none", "old") == []


def test_where_the_time_went_by_phase(analysed: tuple[dict, str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Per arm, the mean run's wall seconds by phase from the time/* metrics; the scoring pass apart from the rest of
    the update; runs from before the timings give NaN, not a zero that reads as free."""
    from bench.phases import PhaseSeconds

    arms, _, _ = analysed
    aepo = PhaseSeconds(**arms["aepo"]["phases_s"])
    # s0: sft 60, eval 30 + 30, rollout 24, update 30 (scoring 6); s1: 120, 30 + 50, 36, 75 (15); 3 steps each
    assert aepo == PhaseSeconds(sft=90.0, eval=70.0, rollout=30.0, update=52.5, scoring_pass=10.5, steps=3)
    assert aepo.per_step("rollout") == pytest.approx(10.0) and aepo.per_step("scoring_pass") == pytest.approx(3.5)
    assert aepo.per_step("gradient") == pytest.approx(14.0) and aepo.total == pytest.approx(242.5)
    grpo = PhaseSeconds(**arms["grpo"]["phases_s"])
    assert math.isnan(grpo.total) and grpo.steps == 0 and math.isnan(grpo.per_step("rollout"))
    report(arms, 2, DATASET)
    assert "Where a run's time went" in capsys.readouterr().out


def test_curves_against_the_tokens_spent(analysed: tuple[dict, str, str]) -> None:
    """x is the seed mean of the cumulative generated tokens at each step (110, 250, 390 for aepo); grpo's runs
    predate the token count and get no such curve."""
    arms, _, _ = analysed
    aepo = by_tokens(arms["aepo"]["curves"])
    assert aepo[ENTROPY] == bands([(110, 1.1, 1.0, 1.2), (250, 1.0, 0.9, 1.1), (390, 0.9, 0.8, 1.0)])
    assert aepo["rollout/reward_mean"] == bands([(110, -0.25, -0.5, 0.0), (250, 0.0, 0.0, 0.0), (390, 0.5, 0.5, 0.5)])
    assert "rollout/tool_calls_mean" not in aepo and by_tokens(arms["grpo"]["curves"]) == {}
    assert arms["aepo"]["generated_tokens_per_run"]["per_seed"] == {0: 400.0, 1: 380.0}
    assert arms["grpo"]["generated_tokens_per_run"] is None


def test_the_clipped_share_of_update_tokens_over_seeds(analysed: tuple[dict, str, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Each run's mean over its steps (aepo: 0.01 and 0.02), then over seeds (t = 12.706 for two); in per cent in
    the table. grpo's runs never logged it: none, not 0."""
    arms, _, _ = analysed
    clip = OverSeeds(**arms["aepo"]["clip_frac_per_run"])
    half = 12.7062 * (0.01 * math.sqrt(2) / 2) / math.sqrt(2)  # t · sd(0.01, 0.02) / √2
    assert clip.per_seed == {0: pytest.approx(0.01), 1: pytest.approx(0.02)}
    assert (clip.mean, clip.high) == (pytest.approx(0.015), pytest.approx(0.015 + half, abs=1e-5))
    assert arms["grpo"]["clip_frac_per_run"] is None
    one_seed = dataclasses.asdict(OverSeeds.of({0: 0.01}))  # no bounds with one seed
    assert _percent(one_seed).startswith("1.00") and _percent(None) == "–"
    report(arms, 2, DATASET)
    out = capsys.readouterr().out
    assert "clipped update tokens" in out and "1.50 [" in out


def test_ols_slope_weighs_every_step() -> None:
    assert ols_slope([(1, 1.0), (2, 0.4), (3, 0.2)]) == pytest.approx(-0.4)
    # one outlying last step moves the slope by its share; last/first would move by all of it
    assert ols_slope([(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0)]) == pytest.approx(0.2)
    assert ols_slope([(1, 1.0)]) is None and ols_slope([]) is None


def test_pass_at_1_and_the_entropy_slope_over_seeds(analysed: tuple[dict, str, str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Per arm, a Student-t interval over the seeds' runs (1 df for two seeds: t = 12.706)."""
    arms, _, _ = analysed
    grpo = OverSeeds(**arms["grpo"]["entropy_slope"])
    assert grpo.per_seed == {0: pytest.approx(-0.4), 1: pytest.approx(-0.5)}  # 1 → 0.4 → 0.2 and 1 → 0.5
    half = 12.7062 * 0.1 / 2  # t(0.975, 1) · sd(−0.4, −0.5) / √2
    assert (grpo.mean, grpo.low, grpo.high) == (pytest.approx(-0.45), pytest.approx(-0.45 - half, abs=1e-4),
                                                pytest.approx(-0.45 + half, abs=1e-4))
    assert grpo.sign == "0 in CI"  # two seeds cannot tell a falling entropy from noise here
    aepo = OverSeeds(**arms["aepo"]["entropy_slope"])
    assert aepo.mean == pytest.approx(-0.1) and aepo.high == pytest.approx(-0.1) and aepo.sign == "< 0"
    assert arms["aepo"]["pass@1_over_seeds"]["per_seed"] == {0: pytest.approx(5 / 8), 1: pytest.approx(5 / 8)}
    assert OverSeeds.of({3: 0.5}).sign == "one seed"
    report(arms, 2, DATASET, paired_differences(arms, 200))
    out = capsys.readouterr().out
    assert "Over seeds" in out and "Paired differences" in out and "0.625 0.625" in out
    assert "by question family" in out and "two_hop" in out


def test_paired_differences_are_seed_matched(analysed: tuple[dict, str, str]) -> None:
    """Seed s of aepo against seed s of grpo: per question 1 − .5, .5 − .5, 0, 1 − 1 (seed 0) and 1 − 1, 1 − 0, 0,
    .5 − 1 (seed 1), both +0.125; the entropy slopes −0.1 − (−0.4) and −0.1 − (−0.5)."""
    arms, _, _ = analysed
    paired = paired_differences(arms, 200)
    assert list(paired) == ["aepo - grpo"]
    pair = paired["aepo - grpo"]
    assert pair["pass@1"]["per_seed"] == {0: pytest.approx(0.125), 1: pytest.approx(0.125)}
    assert pair["pass@1_given_seeds"]["diff"] == pytest.approx(0.125) and pair["pass@1_given_seeds"]["runs"] == 2
    assert pair["entropy_slope"]["per_seed"] == {0: pytest.approx(0.3), 1: pytest.approx(0.4)}
    # by family, from the evaluation files' families: single-hop q0, q1 (+.25, +.5), two-hop q2, q3 (0, −.25)
    assert arms["aepo"]["question_family"] == {"q0": "single_hop", "q1": "single_hop", "q2": "two_hop",
                                               "q3": "two_hop"}
    assert {f: d["per_seed"] for f, d in pair["by_family"].items()} == {
        "single_hop": {0: pytest.approx(0.25), 1: pytest.approx(0.5)},
        "two_hop": {0: pytest.approx(0.0), 1: pytest.approx(-0.25)}}
    # a seed only one arm has is not paired
    lone = {**arms, "grpo": {**arms["grpo"], "per_question_pass@1_by_seed": {
        0: arms["grpo"]["per_question_pass@1_by_seed"][0], 7: {"q0": 1.0}}}}
    assert paired_differences(lone, 200)["aepo - grpo"]["pass@1"]["seeds"] == 1
    assert pair["p_over_seeds"] == 0.0 and pair["p_holm"] == 0.0  # +0.125 on both seeds: no spread
    assert paired_differences(lone, 200)["aepo - grpo"]["p_over_seeds"] is None  # one seed: untestable


def test_paired_differences_test_every_pair_and_correct_for_their_number() -> None:
    """Three arms, three pairs: each pair's t-test over its per-seed differences, then Holm over the three. Per seed
    (two questions, a − b): aepo − arpo +0.5, +0.25, +0.5; aepo − grpo +0.5, 0, −0.25; arpo − grpo 0, −0.25, −0.75."""
    from aepo_core.metrics import t_test_p

    def arm(*seeds: tuple[float, float]) -> dict[str, Any]:
        return {"per_question_pass@1_by_seed": {s: {"q0": q0, "q1": q1} for s, (q0, q1) in enumerate(seeds)},
                "entropy_slope": None, "question_family": {"q0": "single_hop", "q1": "two_hop"}}

    arms = {"aepo": arm((1, 1), (1, 0.5), (1, 0.5)), "arpo": arm((1, 0), (0.5, 0.5), (0.5, 0)),
            "grpo": arm((0.5, 0.5), (1, 0.5), (1, 1))}
    paired = paired_differences(arms, 200)
    assert list(paired) == ["aepo - arpo", "aepo - grpo", "arpo - grpo"]
    per_seed = {name: list(pair["pass@1"]["per_seed"].values()) for name, pair in paired.items()}
    assert per_seed == {"aepo - arpo": pytest.approx([0.5, 0.25, 0.5]), "aepo - grpo": pytest.approx([0.5, 0, -0.25]),
                        "arpo - grpo": pytest.approx([0, -0.25, -0.75])}
    p = {name: t_test_p(v) for name, v in per_seed.items()}
    assert {name: pair["p_over_seeds"] for name, pair in paired.items()} == pytest.approx(p)
    (p1, n1), (p2, n2), (p3, n3) = sorted((v, k) for k, v in p.items())  # Holm: ×3, ×2, ×1, kept monotone
    holm = {n1: min(1, 3 * p1), n2: min(1, max(3 * p1, 2 * p2)), n3: min(1, max(3 * p1, 2 * p2, p3))}
    assert {name: pair["p_holm"] for name, pair in paired.items()} == pytest.approx(holm)
    assert all(pair["p_holm"] >= pair["p_over_seeds"] for pair in paired.values())
    # each family's questions alone (here one question each): aepo − arpo on q0 0, +0.5, +0.5; on q1 +1, 0, +0.5
    family = paired["aepo - arpo"]["by_family"]
    assert list(family) == ["single_hop", "two_hop"]
    assert list(family["single_hop"]["per_seed"].values()) == pytest.approx([0.0, 0.5, 0.5])
    assert list(family["two_hop"]["per_seed"].values()) == pytest.approx([1.0, 0.0, 0.5])
    one_family = {n: {**a, "question_family": {"q0": "single_hop", "q1": "single_hop"}} for n, a in arms.items()}
    assert paired_differences(one_family, 200)["aepo - arpo"]["by_family"] == {}  # one family: nothing to split
