"""The rollout study's base config is frozen: its k = 12 arms resume on the cached SFT start its k = 8 arms used."""

from __future__ import annotations

import json
from pathlib import Path

from bench.compare_algorithms import _sft_key
from bench.rollout_study import BASE
from infra.config_files import load_config

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "rollout_study_v3_amx" / "study.json"


def test_the_study_base_gives_the_sft_start_its_stored_arms_were_sampled_from() -> None:
    # The demo's regime changed under issue 27 (96 SFT transcripts, another budget); had the study kept inheriting
    # configs/demo.yaml, its SFT key would have changed and a resumed study would mix two policies.
    stored = json.loads(RESULTS.read_text())["policy"]
    assert Path(stored).name == f"compare-sft-{_sft_key(load_config(BASE))}"
    assert _sft_key(load_config(BASE)) != _sft_key(load_config(BASE.parent / "demo.yaml"))


def test_the_sft_start_is_keyed_by_the_seed_that_orders_sft() -> None:
    """``train.sft.seed`` orders SFT's batches in place of the run's seed: runs that differ only in the run's seed
    share a start when it is fixed, and a start keyed before the field existed keeps its key."""
    base = load_config(BASE)

    def key(*sets: str) -> str:
        return _sft_key(load_config(BASE, list(sets)))

    assert key("train.sft.seed=null") == _sft_key(base)
    assert key("seed=1", f"train.sft.seed={base.seed}") == _sft_key(base)
    assert key("seed=1") != _sft_key(base)
    assert key(f"train.sft.seed={base.seed + 1}") == key(f"seed={base.seed + 1}")


def test_settings_that_do_not_change_sft_keep_its_key() -> None:
    """Tool latency (issue 56) delays calls and never changes a transcript; the rollout's scheduling is not SFT's."""
    base = _sft_key(load_config(BASE))
    assert _sft_key(load_config(BASE, ["tools.search.latency.kind=fixed", "tools.search.latency.mean_s=2",
                                       "rollout.scheduling=per_path"])) == base
    assert _sft_key(load_config(BASE, ["tools.search.top_k=5"])) != base  # the search results do change them
