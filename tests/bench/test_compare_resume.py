"""bench.compare_algorithms continues a sweep it finds in the runs dir (issue 27 §3, §5): a comparison too long for
one working session runs seed by seed (`--seeds 0`, then `--seeds 1`, …) into one store, every invocation under the
same parent run, the finished cells never trained again. Before, each invocation started a parent run of its own
(and re-parented the finished children to it), so the store showed one sweep per invocation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.compare_algorithms import main

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY_SWEEP = REPO / "configs" / "sweeps" / "tiny.yaml"


def test_a_second_invocation_continues_the_same_sweep(prefect_harness: Any, model_cache: Path,
                                                       tmp_path: Path) -> None:
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    args = ["--sweep", str(TINY_SWEEP), "--no-shared-sft", "--runs-dir", str(tmp_path),
            f"--set=model.cache_dir={model_cache}"]
    first_out, second_out = tmp_path / "first.json", tmp_path / "second.json"
    assert main([*args, "--seeds", "0", "--out", str(first_out)]) == 0
    assert main([*args, "--seeds", "0", "1", "--out", str(second_out)]) == 0
    first, second = (json.loads(p.read_text()) for p in (first_out, second_out))
    assert second["sweep"]["parent_run_id"] == first["sweep"]["parent_run_id"]
    tracker = Tracker(tracking_uri_for(tmp_path))
    runs = tracker.search_runs(filter_string="attributes.status = 'FINISHED'")
    names = sorted(runs["tags.mlflow.runName"])
    # one parent and four cells: seed 0's two cells were not trained a second time
    assert names == ["tiny-sweep-bench", "tiny-sweep-bench-aepo-s0", "tiny-sweep-bench-aepo-s1",
                     "tiny-sweep-bench-grpo-s0", "tiny-sweep-bench-grpo-s1"], names
    parent = first["sweep"]["parent_run_id"]
    children = runs[runs["tags.mlflow.runName"] != "tiny-sweep-bench"]
    assert set(children["tags.mlflow.parentRunId"]) == {parent}
    assert second["runs_analysed"] == 4


def test_the_arms_on_a_shared_start_do_not_depend_on_the_base_sft_order_seed(tmp_path: Path) -> None:
    """The demo fixed ``train.sft.seed`` after the powered comparison's 20 cells had run on its shared start. The arms
    run no SFT, so the seed is moot in them: at its default their configs hash as the stored cells' did, and a resumed
    sweep skips those cells instead of training them again (~16-19 min each)."""
    from bench.compare_algorithms import sweep_spec
    from infra.run.sweep_spec import load_sweep

    sweep = REPO / "configs" / "sweeps" / "claims_powered.yaml"

    def hashes(*sets: str) -> dict[str, str]:
        spec = load_sweep(sweep_spec(sweep, list(sets), [0, 1], None, tmp_path / "compare-sft-x"))
        return {run.run_name: run.config.config_hash() for run in spec.runs}

    assert hashes() == hashes("train.sft.seed=null") != hashes("train.sft.seed=null", "optim.lr=1e-6")
