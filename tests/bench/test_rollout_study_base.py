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
