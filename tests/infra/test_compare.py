"""The comparison of training runs (infra.run.compare: what ``aepo compare``, its flow and bench/compare_algorithms.py
compute), read back from a real MLflow store (SQLite in tmp_path) whose sweep children carry metric histories and
final evaluations logged here: which runs, seed bands, metrics missing from older runs, the entropy trend, the curves
against the tokens spent, the statistics over seeds, the mechanism activity, the seed-matched paired differences
with Holm's correction, the records every output format prints, the parent run's artifacts."""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from compare_store import DATASET, TOP1, make_store
from PIL import Image

from aepo_core.evaluation import OverSeeds
from infra.run.compare import (
    CLIP,
    CURVES_ARTIFACT_DIR,
    ENTROPY,
    AlgorithmComparison,
    ArmResult,
    ComparisonError,
    Selection,
    compare_runs,
    comparison_figures,
    entropy_trend,
    given_runs,
    log_comparison,
    ols_slope,
    paired_differences,
    sweep_selection,
)
from infra.tracking.run import Tracker

REPO = Path(__file__).resolve().parents[2]

def bands(expected: list[tuple[float, ...]]) -> list[object]:
    """``expected`` for ``==`` up to float rounding, band by band."""
    return [pytest.approx(b) for b in expected]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_store(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def compared(store: tuple[str, str]) -> AlgorithmComparison:
    uri, _ = store
    selection = sweep_selection(Tracker(uri), str(REPO / "configs" / "sweeps" / "tiny.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        return compare_runs(selection, Path(tmp))


def test_a_sweep_is_found_by_its_file_its_name_or_its_parent_run(store: tuple[str, str]) -> None:
    """The finished children only (the RUNNING re-run of aepo seed 0 does not replace the finished one), the legacy
    child by the file's run names; by name or parent id without the file, it has no cell tag and is left out."""
    uri, parent = store
    tracker = Tracker(uri)
    by_file = sweep_selection(tracker, str(REPO / "configs" / "sweeps" / "tiny.yaml"))
    assert [(r.arm, r.seed) for r in by_file.runs] == [("aepo", 0), ("aepo", 1), ("grpo", 0), ("grpo", 1)]
    assert (by_file.parent_run_id, by_file.sweep_name) == (parent, "tiny-sweep")
    assert all(r.run_name != "tiny-sweep-aepo-s0" or tracker.client.get_run(r.run_id).info.status == "FINISHED"
               for r in by_file.runs)
    for target in ("tiny-sweep", parent):
        assert [(r.arm, r.seed) for r in sweep_selection(tracker, target).runs] == [("aepo", 0), ("aepo", 1),
                                                                                    ("grpo", 1)]
    assert [(r.arm, r.seed) for r in by_file.only(["grpo", "aepo"], [1]).runs] == [("grpo", 1), ("aepo", 1)]


def test_a_mistake_in_what_to_compare_is_named(store: tuple[str, str]) -> None:
    uri, _ = store
    tracker = Tracker(uri)
    with pytest.raises(ComparisonError, match=r"no sweep named 'nosuch' .*\(sweeps: tiny-sweep\)"):
        sweep_selection(tracker, "nosuch")
    with pytest.raises(ComparisonError, match="no sweep file"):
        sweep_selection(tracker, "missing.yaml")
    with pytest.raises(ComparisonError, match="no run 0123456789abcdef0123456789abcdef"):
        sweep_selection(tracker, "0123456789abcdef0123456789abcdef")
    selection = sweep_selection(tracker, "tiny-sweep")
    with pytest.raises(ComparisonError, match=r"no arm dapo among the runs \(did you mean 'aepo'\?\) \(arms: aepo, "
                                              r"grpo\)"):
        selection.only(["dapo"], None)
    with pytest.raises(ComparisonError, match="no run of seed 7"):
        selection.only(None, [7])
    with pytest.raises(ComparisonError, match=r"is RUNNING, not FINISHED"):
        running = tracker.search_runs(filter_string="attributes.status = 'RUNNING'")
        given_runs(tracker, [str(running.iloc[0]["run_id"])])
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(ComparisonError, match="no final evaluation on 'hotpot'"):
        compare_runs(selection, Path(tmp), dataset="hotpot")
    with pytest.raises(ComparisonError, match="has no finished sweep cell"):
        sweep_selection(tracker, str(tracker.search_runs(filter_string="attributes.status = 'RUNNING'")
                                     .iloc[0]["run_id"]))


def test_runs_named_by_id_take_their_arm_from_their_tags(store: tuple[str, str]) -> None:
    uri, parent = store
    tracker = Tracker(uri)
    done = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{parent}' AND attributes.status = "
                                             "'FINISHED'", order_by=["attributes.start_time ASC"])
    selection = given_runs(tracker, list(done["run_id"]))
    assert [(r.arm, r.seed) for r in selection.runs] == [("aepo", 0), ("aepo", 1), ("grpo", 0), ("grpo", 1)]
    assert selection.parent_run_id is None  # nowhere to log: the flow keeps the comparison in its result
    with pytest.raises(ComparisonError, match="two runs are aepo seed 0"):
        given_runs(tracker, [done["run_id"].iloc[0]] * 2)


def test_curves_are_seed_means_with_min_max_bands(compared: AlgorithmComparison) -> None:
    aepo, grpo = compared.arm("aepo").curves, compared.arm("grpo").curves
    assert aepo[ENTROPY] == bands([(1, 1.1, 1.0, 1.2), (2, 1.0, 0.9, 1.1), (3, 0.9, 0.8, 1.0)])
    # a step one seed did not reach averages the seeds that did
    assert grpo[ENTROPY] == bands([(1, 1.0, 1.0, 1.0), (2, 0.45, 0.4, 0.5), (3, 0.2, 0.2, 0.2)])
    assert aepo["rollout/reward_mean"] == bands([(1, -0.25, -0.5, 0.0), (2, 0.0, 0.0, 0.0), (3, 0.5, 0.5, 0.5)])
    # the branch share only the new aepo run logged: its band is that run alone; grpo (never logged) has none
    assert aepo[TOP1] == bands([(1, 0.5, 0.5, 0.5), (2, 0.6, 0.6, 0.6), (3, 0.7, 0.7, 0.7)])
    assert TOP1 not in grpo and "rollout/tool_calls_mean" not in aepo
    a = compared.arm("aepo")
    assert a.pass1_over_seeds.per_seed == {0: pytest.approx(5 / 8), 1: pytest.approx(5 / 8)}
    assert a.per_question_pass1_by_seed == {0: {"q0": 1.0, "q1": 0.5, "q2": 0.0, "q3": 1.0},
                                            1: {"q0": 1.0, "q1": 1.0, "q2": 0.0, "q3": 0.5}}
    assert compared.arm("grpo").train_reward_last_step == pytest.approx(0.0)
    assert a.tool_calls_per_question == pytest.approx(1.5) and a.rl_wall_s_per_run == pytest.approx(11.0)
    assert (compared.dataset, compared.k, compared.baseline) == (DATASET, 2, "grpo")


def test_entropy_is_judged_by_the_runs_slopes_over_seeds(compared: AlgorithmComparison) -> None:
    """The seed-mean curve is described (first, last, slope); rising or falling is the sign of the runs' slopes
    over seeds where their interval excludes 0. No last/first ratio: it rests on two steps, and a rise from a
    near-zero start (0.04 → 0.10 nats after SFT) read as "exploded"."""
    trend = compared.arm("aepo").entropy_trend
    assert trend is not None and (trend.first, trend.last, trend.slope) == (pytest.approx(1.1), pytest.approx(0.9),
                                                                            pytest.approx(-0.1))
    rows = {r["arm"]: r for r in compared.arm_records()}
    assert rows["aepo"]["entropy trend"] == "falling" and rows["grpo"]["entropy trend"] == "none shown (0 in CI)"
    assert entropy_trend([(1, 1.0, 1.0, 1.0)]) is None  # one step: no trend
    rise = entropy_trend([(1, 0.04, 0.04, 0.04), (2, 0.07, 0.07, 0.07), (3, 0.10, 0.10, 0.10)])
    assert rise is not None and rise.slope == pytest.approx(0.03) and (rise.first, rise.last) == (0.04, 0.10)


def test_figures_written_and_logged_to_the_parent(compared: AlgorithmComparison, store: tuple[str, str],
                                                  tmp_path: Path) -> None:
    """The figures and the tables go to the sweep's parent run; the tables read back as MLflow tables equal to the
    records."""
    uri, parent = store
    out = tmp_path / "claims"
    written = comparison_figures(compared, out, "tiny-sweep")
    assert [p.name for p in written] == ["entropy_over_training.png", "training_curves.png", "curves_by_tokens.png"]
    for path in written:
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size[0] > 300
    logged = log_comparison(compared, parent, written)
    assert "compare/arms.json" in logged and "compare/comparison.json" in logged
    client = Tracker(uri).client
    names = sorted(Path(f.path).name for f in client.list_artifacts(parent, CURVES_ARTIFACT_DIR))
    assert names == ["curves_by_tokens.png", "entropy_over_training.png", "training_curves.png"]
    def table(name: str) -> pd.DataFrame:  # as MLflow's table view reads it (load_table searches the global store)
        return pd.read_json(client.download_artifacts(parent, f"compare/{name}.json", str(tmp_path)), orient="split")

    arms = table("arms")
    assert list(arms["arm"]) == ["aepo", "grpo"] and list(arms["pass@1"]) == pytest.approx([5 / 8, 0.5])
    assert list(table("pairs")["pair"]) == ["aepo - grpo"] * 3  # all questions, then each family
    tagged = json.loads(client.get_run(parent).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "compare/arms.json", "type": "table"} in tagged
    # a second comparison replaces the tables (MLflow's log_table would append to them) and tags them once
    log_comparison(compared, parent, [])
    assert list(table("arms")["arm"]) == ["aepo", "grpo"]
    assert json.loads(client.get_run(parent).data.tags["mlflow.loggedArtifacts"]) == tagged
    # no curves at all (runs from before any of these metrics): no figure, no error
    bare = replace(compared, arms=[replace(a, curves={}) for a in compared.arms])
    assert comparison_figures(bare, tmp_path / "none", "old") == []


def test_curves_against_the_tokens_spent(compared: AlgorithmComparison) -> None:
    """x is the seed mean of the cumulative generated tokens at each step (110, 250, 390 for aepo); grpo's runs
    predate the token count and get no such curve."""
    aepo = compared.arm("aepo").curves_by_tokens()
    assert aepo[ENTROPY] == bands([(110, 1.1, 1.0, 1.2), (250, 1.0, 0.9, 1.1), (390, 0.9, 0.8, 1.0)])
    assert aepo["rollout/reward_mean"] == bands([(110, -0.25, -0.5, 0.0), (250, 0.0, 0.0, 0.0), (390, 0.5, 0.5, 0.5)])
    assert "rollout/tool_calls_mean" not in aepo and compared.arm("grpo").curves_by_tokens() == {}
    tokens = compared.arm("aepo").generated_tokens
    assert tokens is not None and tokens.per_seed == {0: 400.0, 1: 380.0}
    assert compared.arm("grpo").generated_tokens is None
    curve = [r for r in compared.curve_records() if r["arm"] == "aepo" and r["metric"] == ENTROPY]
    assert [(r["step"], r["generated tokens"]) for r in curve] == [(1, 110.0), (2, 250.0), (3, 390.0)]


def test_the_mechanism_activity_over_seeds(compared: AlgorithmComparison) -> None:
    """Each run's mean over its steps (aepo clipped 0.01 and 0.02; ΔH 0.3 and 0.5), then over seeds (t = 12.706 for
    two). grpo's runs never logged them: absent, not 0."""
    activity = compared.arm("aepo").activity
    clip = activity[CLIP]
    half = 12.7062 * (0.01 * math.sqrt(2) / 2) / math.sqrt(2)  # t · sd(0.01, 0.02) / √2
    assert clip.per_seed == {0: pytest.approx(0.01), 1: pytest.approx(0.02)}
    assert (clip.mean, clip.high) == (pytest.approx(0.015), pytest.approx(0.015 + half, abs=1e-5))
    assert activity["rollout/delta_h_mean"].per_seed == {0: pytest.approx(0.3), 1: pytest.approx(0.5)}
    assert compared.arm("grpo").activity == {}
    rows = {r["arm"]: r for r in compared.arm_records()}
    assert rows["aepo"]["clipped update tokens"] == pytest.approx(0.015)
    assert rows["grpo"]["clipped update tokens"] is None
    per_run = [r for r in compared.run_records() if r["arm"] == "aepo"]
    assert [(r["seed"], r["clipped update tokens"]) for r in per_run] == [(0, pytest.approx(0.01)),
                                                                         (1, pytest.approx(0.02))]


def test_ols_slope_weighs_every_step() -> None:
    assert ols_slope([(1, 1.0), (2, 0.4), (3, 0.2)]) == pytest.approx(-0.4)
    # one outlying last step moves the slope by its share; last/first would move by all of it
    assert ols_slope([(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0)]) == pytest.approx(0.2)
    assert ols_slope([(1, 1.0)]) is None and ols_slope([]) is None


def test_pass_at_1_and_the_entropy_slope_over_seeds(compared: AlgorithmComparison) -> None:
    """Per arm, a Student-t interval over the seeds' runs (1 df for two seeds: t = 12.706)."""
    grpo = compared.arm("grpo").entropy_slope
    assert grpo is not None and grpo.per_seed == {0: pytest.approx(-0.4), 1: pytest.approx(-0.5)}
    half = 12.7062 * 0.1 / 2  # t(0.975, 1) · sd(−0.4, −0.5) / √2
    assert (grpo.mean, grpo.low, grpo.high) == (pytest.approx(-0.45), pytest.approx(-0.45 - half, abs=1e-4),
                                                pytest.approx(-0.45 + half, abs=1e-4))
    assert grpo.sign == "0 in CI"  # two seeds cannot tell a falling entropy from noise here
    aepo = compared.arm("aepo").entropy_slope
    assert aepo is not None and aepo.mean == pytest.approx(-0.1) and aepo.high == pytest.approx(-0.1)
    assert aepo.sign == "< 0" and OverSeeds.of({3: 0.5}).sign == "one seed"
    vs = compared.arm("aepo").vs_baseline
    assert vs is not None and vs.diff == pytest.approx(0.125) and compared.arm("grpo").vs_baseline is None


def test_paired_differences_are_seed_matched(compared: AlgorithmComparison) -> None:
    """Seed s of aepo against seed s of grpo: per question 1 − .5, .5 − .5, 0, 1 − 1 (seed 0) and 1 − 1, 1 − 0, 0,
    .5 − 1 (seed 1), both +0.125; the entropy slopes −0.1 − (−0.4) and −0.1 − (−0.5)."""
    [pair] = compared.pairs
    assert pair.name == "aepo - grpo"
    assert pair.pass1.per_seed == {0: pytest.approx(0.125), 1: pytest.approx(0.125)}
    assert pair.pass1_given_seeds["diff"] == pytest.approx(0.125) and pair.pass1_given_seeds["runs"] == 2
    assert pair.entropy_slope is not None and pair.entropy_slope.per_seed == {0: pytest.approx(0.3),
                                                                              1: pytest.approx(0.4)}
    # by family, from the evaluation files' families: single-hop q0, q1 (+.25, +.5), two-hop q2, q3 (0, −.25)
    assert compared.arm("aepo").question_family == {"q0": "single_hop", "q1": "single_hop", "q2": "two_hop",
                                                    "q3": "two_hop"}
    assert {f: d.per_seed for f, d in pair.by_family.items()} == {
        "single_hop": {0: pytest.approx(0.25), 1: pytest.approx(0.5)},
        "two_hop": {0: pytest.approx(0.0), 1: pytest.approx(-0.25)}}
    assert pair.p_over_seeds == 0.0 and pair.p_holm == 0.0  # +0.125 on both seeds: no spread
    # a seed only one arm has is not paired
    grpo = compared.arm("grpo")
    lone = replace(grpo, per_question_pass1_by_seed={0: grpo.per_question_pass1_by_seed[0], 7: {"q0": 1.0}})
    [one] = paired_differences([compared.arm("aepo"), lone], 200)
    assert one.pass1.seeds == 1 and one.p_over_seeds is None and one.p_holm is None  # one seed: untestable
    rows = compared.pair_records()
    assert [(r["pair"], r["family"]) for r in rows] == [("aepo - grpo", "all"), ("aepo - grpo", "single_hop"),
                                                        ("aepo - grpo", "two_hop")]
    assert rows[0]["seeds a above b"] == 2


def _arm(name: str, *seeds: tuple[float, float]) -> ArmResult:
    """An arm with two questions per seed (q0 single-hop, q1 two-hop) and nothing else measured."""
    from aepo_core.evaluation import Interval

    per_seed = {s: {"q0": q0, "q1": q1} for s, (q0, q1) in enumerate(seeds)}
    nan = Interval(math.nan, math.nan, math.nan)
    return ArmResult(name, [], [], 2, nan, nan, OverSeeds.of({s: (a + b) / 2 for s, (a, b) in enumerate(seeds)}), {},
                     per_seed, {"q0": "single_hop", "q1": "two_hop"}, None, None, {}, *[math.nan] * 7, None)


def test_paired_differences_test_every_pair_and_correct_for_their_number() -> None:
    """Three arms, three pairs: each pair's t-test over its per-seed differences, then Holm over the three. Per seed
    (two questions, a − b): aepo − arpo +0.5, +0.25, +0.5; aepo − grpo +0.5, 0, −0.25; arpo − grpo 0, −0.25, −0.75."""
    from aepo_core.metrics import t_test_p

    arms = [_arm("aepo", (1, 1), (1, 0.5), (1, 0.5)), _arm("arpo", (1, 0), (0.5, 0.5), (0.5, 0)),
            _arm("grpo", (0.5, 0.5), (1, 0.5), (1, 1))]
    paired = {p.name: p for p in paired_differences(arms, 200)}
    assert list(paired) == ["aepo - arpo", "aepo - grpo", "arpo - grpo"]
    per_seed = {name: list(pair.pass1.per_seed.values()) for name, pair in paired.items()}
    assert per_seed == {"aepo - arpo": pytest.approx([0.5, 0.25, 0.5]), "aepo - grpo": pytest.approx([0.5, 0, -0.25]),
                        "arpo - grpo": pytest.approx([0, -0.25, -0.75])}
    p = {name: t_test_p(v) for name, v in per_seed.items()}
    assert {name: pair.p_over_seeds for name, pair in paired.items()} == pytest.approx(p)
    (p1, n1), (p2, n2), (p3, n3) = sorted((v, k) for k, v in p.items())  # Holm: ×3, ×2, ×1, kept monotone
    holm = {n1: min(1, 3 * p1), n2: min(1, max(3 * p1, 2 * p2)), n3: min(1, max(3 * p1, 2 * p2, p3))}
    assert {name: pair.p_holm for name, pair in paired.items()} == pytest.approx(holm)
    assert all((pair.p_holm or 0) >= (pair.p_over_seeds or 0) for pair in paired.values())
    # each family's questions alone (here one question each): aepo − arpo on q0 0, +0.5, +0.5; on q1 +1, 0, +0.5
    family = paired["aepo - arpo"].by_family
    assert list(family) == ["single_hop", "two_hop"]
    assert list(family["single_hop"].per_seed.values()) == pytest.approx([0.0, 0.5, 0.5])
    assert list(family["two_hop"].per_seed.values()) == pytest.approx([1.0, 0.0, 0.5])
    one_family = [replace(a, question_family={"q0": "single_hop", "q1": "single_hop"}) for a in arms]
    assert paired_differences(one_family, 200)[0].by_family == {}  # one family: nothing to split


def test_the_json_document_keeps_the_bench_layout(compared: AlgorithmComparison) -> None:
    """bench/power.py reads compare_algorithms.json: its arms' pass@1_by_seed and the per-arm tables at the top."""
    doc = compared.as_json()
    assert doc["arms"]["aepo"]["pass@1_by_seed"] == {0: pytest.approx(5 / 8), 1: pytest.approx(5 / 8)}
    assert doc["arms"]["aepo"]["clip_frac_per_run"]["per_seed"] == {0: pytest.approx(0.01), 1: pytest.approx(0.02)}
    assert doc["arms"]["aepo"]["vs_grpo"]["diff"] == pytest.approx(0.125) and doc["arms"]["grpo"]["vs_grpo"] is None
    assert set(doc["per_question_pass@1_by_seed"]) == {"aepo", "grpo"} and "aepo - grpo" in doc["paired"]


def test_a_selection_needs_a_run(store: tuple[str, str]) -> None:
    uri, _ = store
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(ComparisonError, match="no final evaluation"):
        compare_runs(Selection([], uri), Path(tmp))


def test_a_store_that_fails_is_a_fault_not_a_missing_run(store: tuple[str, str], monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Only the store's "no such run" becomes the user's mistake (exit 2); any other failure stays itself."""
    from mlflow.exceptions import MlflowException

    uri, parent = store
    tracker = Tracker(uri)

    def broken(run_id: str) -> None:
        raise MlflowException("database is locked", error_code="INTERNAL_ERROR")

    monkeypatch.setattr(tracker.client, "get_run", broken)
    with pytest.raises(MlflowException, match="database is locked"):
        given_runs(tracker, [parent])
