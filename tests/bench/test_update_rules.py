"""bench.update_rules: a bad rule is refused before anything trains; one real run on the tiny tool-using policy
(trained with a checkpoint per step, then two rules compared on two steps) writes the JSON and the figure, and a
second invocation reuses the finished run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.update_rules import main

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def test_a_bad_rule_is_refused_before_anything_trains(prefect_imported: None, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["-c", str(TINY), "--losses", "aepo", "ppo@clip_high=0.3", "--runs-dir", str(tmp_path),
                 "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert code == 2 and "update rule 'ppo@clip_high=0.3'" in err and "Traceback" not in err
    assert not (tmp_path / "o.json").exists() and not (tmp_path / "mlflow.db").exists()


def test_trains_once_compares_the_rules_and_draws_them(prefect_harness: Any, model_cache: Path, tool_user: Path,
                                                        tmp_path: Path) -> None:
    train = [f"model.name={tool_user}", f"model.cache_dir={model_cache}", "data.max_questions=8",
             "eval.max_questions=2", "algorithm.overlong_buffer=64"]  # rewards differ with length: advantages ≠ 0
    args = ["-c", str(TINY), "--name", "tiny-rules", "--train-steps", "3", "--steps", "2", "3", "--losses", "aepo",
            "ppo_clip@clip_low=0,clip_high=0", "--set", "optim.mini_batch_size=1", "--resamples", "100",
            "--runs-dir", str(tmp_path), *(f"--train-set={s}" for s in train)]
    out = tmp_path / "rules.json"
    assert main([*args, "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    assert first["steps"] == [2, 3] and first["rules"] == ["aepo", "ppo_clip@clip_low=0,clip_high=0"]
    assert len(first["rows"]) == 6 * 3 * 2 and first["cpu"] and first["commit"]
    zeroed = {(r["token_class"], r["rule"]): r["value"] for r in first["rows"] if r["quantity"] == "zeroed_share"}
    assert zeroed[("rest", "ppo_clip@clip_low=0,clip_high=0")] > 0  # a zero clip range drops gradients
    png = out.with_suffix(".png")
    assert png.stat().st_size > 20_000

    again = tmp_path / "again.json"
    assert main([*args, "--out", str(again)]) == 0
    second = json.loads(again.read_text())
    assert second["run_id"] == first["run_id"] and second["rows"] == first["rows"]  # reused, and deterministic
