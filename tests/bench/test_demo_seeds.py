"""bench.demo_seeds: the demo's RL gain per seed and micro-batch size. The sweep it builds; the per-run and pooled
figures on hand-made records (the formulas); and one real run of it on the tiny config, whose figures are checked
against what MLflow holds and which a second invocation analyses without training again."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from aepo_core.config_keys import ConfigError
from bench.demo_seeds import RunRecord, cell_summary, family_summaries, main, run_gain, sweep_spec

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def test_one_cell_per_micro_batch_size_or_the_config_s_own() -> None:
    from infra.run.sweep_spec import load_sweep

    spec = load_sweep(sweep_spec(TINY, ["optim.lr=2e-5"], [0, 1], [256, 512], "s"))
    assert list(spec.cells) == ["mb256", "mb512"] and spec.seeds == [0, 1]
    assert [r.run_name for r in spec.runs] == ["s-mb256-s0", "s-mb256-s1", "s-mb512-s0", "s-mb512-s1"]
    assert {r.config.optim.micro_batch_tokens for r in spec.runs if r.cell == "mb512"} == {512}
    assert {r.config.optim.lr for r in spec.runs} == {2e-5}
    plain = load_sweep(sweep_spec(TINY, [], [3], [], "s"))
    assert [r.run_name for r in plain.runs] == ["s-base-s3"] and plain.runs[0].config.optim.micro_batch_tokens == 512
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        load_sweep(sweep_spec(TINY, ["optim.lr"], [0], [], "s"))


def test_a_config_without_the_sft_evaluation_is_refused_before_anything_runs(
        prefect_imported: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["-c", str(TINY), "--seeds", "0", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert code == 2 and "run tiny-seeds-base-s0" in err and "train.sft.enabled=true" in err
    # The bench's own output holds no traceback. A "--- Logging error ---" block after it is the logging module's
    # report on a Prefect console handler that an earlier test bound to a stderr pytest has since closed (the
    # temporary server logs its stop to it): it fails this test only when such a test ran first on the worker.
    own = err.split("--- Logging error ---")[0]
    assert "Traceback" not in own and not (tmp_path / "o.json").exists() and not (tmp_path / "mlflow.db").exists()


def _record(seed: int, sft: list[float], final: list[float]) -> RunRecord:
    """Questions q0, q1 single-hop, the rest two-hop; 2 tool calls per answer after SFT, 1 + seed at the end."""
    qs = [f"q{i}" for i in range(len(sft))]
    pass1 = {"sft": dict(zip(qs, sft, strict=True)), "final": dict(zip(qs, final, strict=True))}
    calls = {"sft": dict.fromkeys(qs, 2.0), "final": dict.fromkeys(qs, 1.0 + seed)}
    family = {q: "single_hop" if i < 2 else "two_hop" for i, q in enumerate(qs)}
    return RunRecord("mb1024", seed, f"r{seed}", f"id{seed}", pass1, family, calls, [(1, 2.0), (2, 1.5)],
                     600.0 + 60 * seed,
                     {"sft": 60.0, "eval": 200.0, "rollout": 250.0, "update": 80.0, "scoring_pass": 0.0}, 1024.0)


def test_per_run_gain_and_the_pooled_gain_over_seeds() -> None:
    # seed 0 gains +0.5 on 4 questions, seed 1 loses 0.25 on 4: 1 of 2 seeds gained, pooled (0.5 − 0.25)/2 = 0.125
    up = _record(0, [0, 0, 0.5, 1], [1, 0.5, 0.5, 1])
    down = _record(1, [1, 1, 0, 0], [1, 0, 0, 0])
    assert run_gain(up, 200)["diff"] == pytest.approx(0.375)
    assert run_gain(down, 200)["diff"] == pytest.approx(-0.25)
    cell = cell_summary([up, down], 500)
    assert cell["pooled_gain"]["diff"] == pytest.approx((0.375 - 0.25) / 2)
    assert cell["positive_seeds"] == 1 and cell["seeds"] == [0, 1]
    assert cell["sft_pass1"] == pytest.approx((0.375 + 0.5) / 2) and cell["final_pass1"] == pytest.approx(0.5)
    assert cell["tool_calls_per_question"] == {"sft": 2.0, "final": 1.5}
    assert cell["wall_s_mean"] == pytest.approx(630.0)
    lo, hi = cell["pooled_gain"]["ci_low"], cell["pooled_gain"]["ci_high"]
    assert lo < 0 < hi  # 8 questions in all: the interval is wide
    # about a new seed: +0.375 and −0.25 give 0.0625 ± t(0.975, 1) · sd / √2 = ± 12.706 · 0.3125 = ± 3.97
    over = cell["gain_over_seeds"]
    assert over["per_seed"] == {0: pytest.approx(0.375), 1: pytest.approx(-0.25)}
    assert over["mean"] == pytest.approx(0.0625) and over["high"] - over["mean"] == pytest.approx(3.9707, abs=1e-3)


def test_a_gain_on_one_family_and_a_loss_on_the_other_are_reported_apart() -> None:
    # both seeds: single-hop questions (q0, q1) 0 → 1, two-hop (q2, q3) 1 → 0; overall exactly 0
    runs = [_record(seed, [0, 0, 1, 1], [1, 1, 0, 0]) for seed in (0, 1)]
    assert cell_summary(runs, 200)["pooled_gain"]["diff"] == 0.0
    families = family_summaries(runs, 200)
    assert set(families) == {"single_hop", "two_hop"}
    single, two = families["single_hop"], families["two_hop"]
    assert single["pooled_gain"]["diff"] == 1.0 and two["pooled_gain"]["diff"] == -1.0
    assert single["positive_seeds"] == 2 and two["positive_seeds"] == 0
    assert single["pooled_gain"]["questions"] == two["pooled_gain"]["questions"] == 4  # 2 questions × 2 runs
    assert (single["sft_pass1"], single["final_pass1"], two["sft_pass1"], two["final_pass1"]) == (0, 1, 1, 0)
    assert two["tool_calls_per_question"] == {"sft": 2.0, "final": 1.5}


def test_runs_the_seeds_and_reads_them_back_from_mlflow(prefect_harness: Any, model_cache: Path, tool_user: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoConfig

    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker
    from infra.training.memory import activation_bytes_per_token

    # the session's tool-using tiny policy (tests/conftest.py), with a one-batch SFT of its own: the evaluation
    # after SFT exists, and the policy calls tools from the first step, so the tool-call figures are not all zero;
    # evaluated on the train questions it memorized, where it answers some right, so Pass@1 is not 0 for any code;
    # a memory budget of 300 tokens' activations: the 512-token cell is capped (and says so), the 256 one is not
    dims = AutoConfig.from_pretrained(tool_user)
    per_token = activation_bytes_per_token(dims.num_hidden_layers, dims.hidden_size, dims.intermediate_size,
                                           checkpointed=True)
    sets = [f"model.name={tool_user}", f"model.cache_dir={model_cache}", "train.sft.enabled=true",
            "train.sft.max_examples=2", "train.sft.epochs=1", "data.max_questions=8", "train.steps=2",
            "checkpoint.every=2", "eval.at_start=true", "eval.before_sft=false", "eval.max_questions=4",
            "eval.datasets=[synthetic:train]", "rollout.max_response_tokens=200",
            f"optim.memory_budget_gb={300.5 * per_token / 1e9}"]
    args = ["-c", str(TINY), "--seeds", "0", "--micro-batch-tokens", "256", "512", "--name", "tiny-seeds",
            "--runs-dir", str(tmp_path), *(f"--set={s}" for s in sets)]
    out = tmp_path / "demo_seeds.json"
    assert main([*args, "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert [r["run_name"] for r in first["runs"]] == ["tiny-seeds-mb256-s0", "tiny-seeds-mb512-s0"]
    assert [r["micro_batch_tokens"] for r in first["runs"]] == [256, 300]
    assert first["capped"] == [line.removeprefix("WARNING ") for line in printed.splitlines()
                               if line.startswith("WARNING ")]
    assert len(first["capped"]) == 1 and first["capped"][0].startswith("tiny-seeds-mb512-s0: micro-batches of 300")
    tracker = Tracker(tracking_uri_for(tmp_path))
    for run in first["runs"]:
        keys = ["eval/synthetic_train/pass_at_1", "eval/synthetic_train/tool_calls_per_question",
                "rollout/tool_calls_mean"]
        history = tracker.metric_history(keys, run_id=run["run_id"])
        # the per-question files agree with MLflow: the SFT evaluation is logged at step 0, the final one at the end
        for stage, at in (("sft", 0), ("final", -1)):
            assert run["pass1"][stage] == pytest.approx(history[keys[0]][at][1])
            assert run["tool_calls_per_question"][stage] == pytest.approx(history[keys[1]][at][1])
        assert history[keys[0]][0][0] == 0 and history[keys[0]][-1][0] == 2
        # eval.before_sft=false: the evaluations after SFT and at the end ran, the base model's did not
        assert sorted(p.name for p in (tmp_path / "eval" / run["run_name"]).iterdir()) == ["final", "sft"]
        assert [tuple(p) for p in run["tool_calls_by_step"]] == history[keys[2]] and len(history[keys[2]]) == 2
        assert run["gain"]["diff"] == pytest.approx(run["pass1"]["final"] - run["pass1"]["sft"])
        assert run["wall_s"] > 0
        phases = run["phases_s"]  # every phase ran and took time; together no more than the run's wall
        assert min(phases["sft"], phases["eval"], phases["rollout"], phases["update"]) > 0
        assert phases["scoring_pass"] <= phases["update"]
        assert phases["sft"] + phases["eval"] + phases["rollout"] + phases["update"] <= run["wall_s"]
    assert sum(r["tool_calls_per_question"]["sft"] for r in first["runs"]) > 0  # the SFT'd policy uses its tools
    assert set(first["pooled"]) == {"mb256", "mb512"} and first["pooled"]["mb256"]["seeds"] == [0]
    assert sum(r["pass1"]["sft"] for r in first["runs"]) > 0, first["runs"]  # the tool user answers some right
    # the printed pooled table is the JSON's: each cell's row names its seeds that gained (the one run's gain > 0)
    # and its Pass@1 after SFT and at the end
    pooled = printed.split("Pooled over seeds")[1].split("by question family")[0]
    for run in first["runs"]:
        cell = first["pooled"][run["cell"]]
        assert cell["positive_seeds"] == int(run["gain"]["diff"] > 0), (run, cell)
        rows = [[c.strip() for c in re.split(r"[│┃]|\s{2,}", line)] for line in pooled.splitlines()]
        (row,) = [[c for c in r if c] for r in rows if run["cell"] in r]  # (a rich table, or plain columns)
        assert row[1:5] == ["1", f"{cell['positive_seeds']}/1", f"{cell['sft_pass1']:.3f}",
                            f"{cell['final_pass1']:.3f}"], row
    for cell, families in first["pooled_by_family"].items():  # the families partition each run's questions
        assert set(families) <= {"single_hop", "two_hop"}
        assert sum(f["pooled_gain"]["questions"] for f in families.values()) == first["pooled"][cell][
            "pooled_gain"]["questions"]
    assert "by question family" in printed
    from infra.store import TrajectoryStore  # every training leaf counted once, in its own run's cell

    stored = TrajectoryStore(tmp_path).read_trajectories(columns=["run_id"])["run_id"].value_counts()
    for run in first["runs"]:
        groups = first["training_leaves"][run["cell"]]
        assert sum(g["leaves"] for g in groups) == stored[run["run_id"]] > 0
        assert all(0 <= g["unclosed"] <= 1 and g["tokens"] > 0 for g in groups)

    # Run again: both runs finished, so nothing trains (the sweep reuses them) and the figures are the same.
    again = tmp_path / "again.json"
    assert main([*args, "--out", str(again)]) == 0
    second = json.loads(again.read_text())
    assert [r["run_id"] for r in second["runs"]] == [r["run_id"] for r in first["runs"]]
    assert second["pooled"] == first["pooled"]
    only = tmp_path / "only.json"
    assert main([*args, "--analyse-only", "--out", str(only)]) == 0
    assert json.loads(only.read_text())["runs"] == first["runs"]
