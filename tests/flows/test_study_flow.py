"""The rollout study flow on the tiny policy: every arm sampled in chunks, the per-question Parquet, the summary that
the Parquet alone reproduces (``--analyse-only``), the figures, the MLflow run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
FAST = ["tracking.system_metrics=false", "eval.bootstrap_samples=200"]


def on_tool_user(tool_user: Path, model_cache: Path) -> list[str]:
    """The study's settings on the session's tool user (conftest.tool_user) over the train questions it memorized:
    it calls tools (so aepo and arpo branch) and answers some right (so Pass@k and the pairs are not all 0)."""
    return [*FAST, f"model.name={tool_user}", f"model.cache_dir={model_cache}", "rollout.max_response_tokens=200"]


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory, prefect_harness: Any, tool_user: Path,
          model_cache: Path) -> tuple[Any, Path]:
    from flows.study import rollout_study

    runs = tmp_path_factory.mktemp("study-runs")
    result = rollout_study(config=str(TINY), overrides=on_tool_user(tool_user, model_cache), runs_dir=str(runs),
                           datasets=["synthetic:train"], ks=[2, 3], max_questions=5, chunk_questions=2, seed=3,
                           run_name="study-test")
    return result, runs


def test_every_arm_is_profiled_on_the_same_questions(study: tuple[Any, Path]) -> None:
    from infra.run.study import Arm, read_profiles

    result, runs = study
    out = runs / "studies" / "study-test"
    assert Path(result.out_dir) == out and result.questions == 5
    profiles = read_profiles(out / "profiles.parquet")
    assert list(profiles) == [Arm(k, m) for k in (2, 3) for m in ("aepo", "arpo", "independent")]
    ids = [p.question_id for p in profiles[Arm(2, "aepo")]]
    assert len(set(ids)) == 5
    for arm, ps in profiles.items():
        assert [p.question_id for p in ps] == ids  # chunks concatenated in question order, every arm alike
        assert all(p.leaves == arm.k for p in ps), arm  # every group full: k leaves
    # independent sampling never branches and plans k global samples
    assert all(p.branch_points == 0 and p.global_budget == 3 for p in profiles[Arm(3, "independent")])
    # the tool user calls tools, so the branching arms fork at tool results, and it answers some questions right
    for k in (2, 3):
        for mode in ("aepo", "arpo"):
            assert sum(p.branch_points for p in profiles[Arm(k, mode)]) > 0, (k, mode)
    assert 0 < sum(p.correct for ps in profiles.values() for p in ps) < sum(p.leaves for ps in profiles.values()
                                                                            for p in ps)


def test_the_summary_is_reproduced_from_the_parquet_alone(study: tuple[Any, Path]) -> None:
    from infra.run.study import read_costs, read_profiles, summarize_study, write_summary

    result, runs = study
    out = runs / "studies" / "study-test"
    saved = json.loads((out / "summary.json").read_text())
    assert saved == result.summary
    again = summarize_study(read_profiles(out / "profiles.parquet"), n_resamples=200, seed=0)
    redone = write_summary(runs / "again.json", again, read_costs(out / "costs.json"), {})
    for label, arm in saved["arms"].items():
        assert arm["estimates"] == redone["arms"][label]["estimates"], label
        assert arm["cost"] == redone["arms"][label]["cost"], label
        assert arm["cost"]["tokens_generated"] > 0 and arm["cost"]["wall_s"] > 0
    assert saved["paired"] == redone["paired"]
    assert set(saved["paired"]) == {f"k{k}/{a}-{b}" for k in (2, 3)
                                    for a, b in (("aepo", "arpo"), ("aepo", "independent"), ("arpo", "independent"))}
    assert saved["rollout"]["k3/arpo"]["initial_rollouts"] == 1  # the paper's k/2 (rounded down), not the base's 2
    assert (out / "rollout_study.png").stat().st_size > 10_000


def test_the_study_is_an_mlflow_run_with_its_metrics_and_files(study: tuple[Any, Path]) -> None:
    from mlflow.tracking import MlflowClient

    result, _runs = study
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags["kind"] == "rollout-study" and run.info.run_name == "study-test"
    m = run.data.metrics
    # Every arm's logged Pass@k is the mean over its questions of the Parquet's per-question outcome (a lost,
    # mislabelled or re-computed metric differs); the arithmetic itself is golden-tested in tests/core/test_study.py.
    from infra.run.study import read_profiles

    profiles = read_profiles(Path(result.out_dir) / "profiles.parquet")
    for arm, ps in profiles.items():
        assert m[f"study/{arm.label}/pass_at_k"] == pytest.approx(sum(p.pass_at_k for p in ps) / len(ps)), arm
    saved = json.loads((Path(result.out_dir) / "summary.json").read_text())
    for label, arm_summary in saved["arms"].items():
        for quantity, estimate in arm_summary["estimates"].items():
            if estimate["mean"] is not None:
                assert m[f"study/{label}/{quantity}"] == pytest.approx(estimate["mean"]), (label, quantity)
    assert m["study/k3/aepo/tokens_generated"] > 0
    assert "study/k2/aepo-arpo/informative" in m
    files = {f.path for f in client.list_artifacts(result.run_id, "study")}
    assert {"study/profiles.parquet", "study/summary.json", "study/rollout_study.png"} <= files


def test_an_unknown_mode_fails_before_any_work(prefect_harness: Any, tmp_path: Path) -> None:
    from flows.study import rollout_study

    with pytest.raises(ValueError, match="mode"):
        rollout_study(config=str(TINY), overrides=FAST, runs_dir=str(tmp_path), modes=["beam"], ks=[2],
                      max_questions=1)
    assert not (tmp_path / "studies").exists()


def test_an_arm_with_settings_and_a_study_that_resumes(prefect_harness: Any, tmp_path: Path, tool_user: Path,
                                                       model_cache: Path) -> None:
    """``aepo@branch_penalty=0.5,premonitor=false`` is an arm of its own, paired against arpo; run again under the
    same name, a study keeps the chunks it has and samples only the rest (a stopped study loses one chunk at
    most), and refuses to resume with other settings."""
    from flows.study import rollout_study
    from infra.run.study import Arm, read_costs, read_profiles, write_costs, write_profiles

    arm = "aepo@branch_penalty=0.5,premonitor=false"
    kw = dict(config=str(TINY), overrides=on_tool_user(tool_user, model_cache), runs_dir=str(tmp_path),
              datasets=["synthetic:train"], ks=[2],
              max_questions=4, chunk_questions=2, seed=3, run_name="resume-test")
    first = rollout_study(modes=["arpo", arm], **kw)
    out = Path(first.out_dir)
    assert set(first.summary["paired"]) == {f"k2/{arm}-arpo"}
    assert first.summary["rollout"][f"k2/{arm}"]["branch_penalty"] == 0.5
    full = read_profiles(out / "profiles.parquet")
    # Stop after one chunk of the second arm: keep its first 2 questions and a cost of 1 s.
    partial = {Arm(2, "arpo"): full[Arm(2, "arpo")], Arm(2, arm): full[Arm(2, arm)][:2]}
    write_profiles(out / "profiles.parquet", partial)
    costs = read_costs(out / "costs.json")
    write_costs(out / "costs.json", {**costs, Arm(2, arm): costs[Arm(2, arm)].__class__(1.0, 0.0, 0.0, 5.0)})
    again = rollout_study(modes=["arpo", arm], **kw)
    resumed = read_profiles(out / "profiles.parquet")
    # the same questions, the kept chunk kept, the rest sampled again with the same seeds: the groups the tool
    # user samples differ (branches, answers), so another seed or question order would change them
    assert len({(p.branch_points, p.correct, p.model_tokens) for p in full[Arm(2, arm)]}) > 1
    assert resumed == full
    after = read_costs(out / "costs.json")
    assert after[Arm(2, "arpo")] == costs[Arm(2, "arpo")]  # nothing of arpo was sampled again
    assert after[Arm(2, arm)].tokens_generated > 5.0 and after[Arm(2, arm)].wall_s > 1.0
    assert again.summary["arms"].keys() == first.summary["arms"].keys()
    with pytest.raises(ValueError, match="seed=3, not 4"):
        rollout_study(modes=["arpo"], **{**kw, "seed": 4})


def test_chunks_are_sampled_chunk_by_chunk_every_arm_in_turn() -> None:
    """A stopped study holds the same questions in every arm but the one it was sampling, so its paired differences
    stay usable; arm by arm, a stop after the first arm would leave nothing to pair."""
    from flows.study import chunks_to_sample
    from infra.run.study import Arm

    a, b = Arm(8, "arpo"), Arm(8, "aepo")
    assert chunks_to_sample([a, b], {}, 5, 2) == [(a, 0), (b, 0), (a, 2), (b, 2), (a, 4), (b, 4)]
    assert chunks_to_sample([a, b], {a: 4, b: 2}, 5, 2) == [(b, 2), (a, 4), (b, 4)]
    assert chunks_to_sample([a, b], {a: 5, b: 5}, 5, 2) == []
