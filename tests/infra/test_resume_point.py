"""Where ``--resume`` continues (infra.run.trainer.find_resume_point), against a real SQLite MLflow store and local
checkpoints: the run is the newest of the name with the config's model and algorithm, its checkpoints are those
under its run id, no checkpoint means step 0 of the same run, no run of the name means nothing to resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import make_config, make_model, make_tokenizer

from infra.run.resume import NothingToResumeError, find_resume_point
from infra.tracking.run import Tracker
from infra.training.checkpoint import save_checkpoint


def _cfg(runs: Path, **overrides: Any) -> Any:
    return make_config(**{"storage.runs_dir": str(runs), "tracking.system_metrics": False, **overrides})


def _run(runs: Path, cfg: Any) -> str:
    tracker = Tracker.from_config(cfg, runs)
    run_id = tracker.start(cfg, run_name="tiny")
    tracker.finish("KILLED")
    return run_id


def test_find_resume_point(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cfg, other_cfg = _cfg(runs), _cfg(runs, **{"algorithm.loss": "ppo_clip"})
    tracker = Tracker.from_config(cfg, runs)
    with pytest.raises(NothingToResumeError, match="no MLflow run named 'tiny' in experiment 'aepo'"):
        find_resume_point(tracker, cfg, runs, "tiny")

    mine = _run(runs, cfg)
    point = find_resume_point(tracker, cfg, runs, "tiny")  # killed before its first checkpoint
    assert (point.run_id, point.step, point.path) == (mine, 0, None)

    model, tokenizer = make_model(0), make_tokenizer()
    save_checkpoint(runs / "checkpoints" / "tiny" / mine, 2, model=model, tokenizer=tokenizer, config=cfg,
                    run_id=mine)
    newer = _run(runs, other_cfg)  # the same name, another algorithm, started later
    point = find_resume_point(tracker, cfg, runs, "tiny")
    assert (point.run_id, point.step) == (mine, 2) and point.where == str(runs / "checkpoints" / "tiny" / mine)
    assert find_resume_point(tracker, other_cfg, runs, "tiny").run_id == newer

    # A checkpoint of the layout before run ids (checkpoints/<name>/step-N) is resumed by its own run only.
    save_checkpoint(runs / "checkpoints" / "tiny", 1, model=model, tokenizer=tokenizer, config=other_cfg,
                    run_id=newer)
    point = find_resume_point(tracker, other_cfg, runs, "tiny")
    assert (point.run_id, point.step) == (newer, 1) and point.where == str(runs / "checkpoints" / "tiny")
    last = _run(runs, cfg)  # now the newest run with cfg's algorithm, without a checkpoint: step 0, not the old one
    point = find_resume_point(tracker, cfg, runs, "tiny")
    assert (point.run_id, point.step) == (last, 0)
