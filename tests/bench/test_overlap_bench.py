"""bench/overlap.py's pieces that do not train: the latency overrides it applies and its baseline check."""

from __future__ import annotations

import pytest

from bench.overlap import ARM, DEMO, REGIME, latency_sets, parse_args
from infra.config_files import load_config


def test_every_arm_delays_both_tools_uncached_at_the_named_setting() -> None:
    cfg = load_config(DEMO, [*REGIME, *ARM, *latency_sets("moderate"), "train.max_staleness=1"])
    for tool in (cfg.tools.search, cfg.tools.python):
        assert (tool.latency.kind, tool.latency.mean_s, tool.latency.p99_s) == ("lognormal", 1.0, 5.0)
    assert not cfg.tools.cache and cfg.train.max_staleness == 1
    assert load_config(DEMO, latency_sets("zero")).tools.search.latency.kind == "none"


def test_an_arm_list_without_the_on_policy_baseline_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--staleness", "1"])
    assert exc.value.code == 2 and "--staleness needs 0" in capsys.readouterr().err
