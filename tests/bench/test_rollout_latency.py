"""bench.rollout_latency: the settings it measures (issue 56's three latencies) and its summary, on hand-made runs:
the best repetition per (mode, setting) and its ratio to the mode's own zero-latency run, judged against the
targets."""

from __future__ import annotations

import pytest

from bench.rollout_latency import SETTINGS, TARGETS, summarize


def test_the_settings_are_the_issue_s() -> None:
    assert SETTINGS["zero"].kind == "none"
    assert (SETTINGS["moderate"].mean_s, SETTINGS["heavy"].mean_s, SETTINGS["heavy"].p99_s) == (1.0, 3.0, 20.0)
    assert TARGETS == {"moderate": 1.2, "heavy": 1.5}


def test_each_setting_against_its_mode_s_zero() -> None:
    runs = {"aepo": {"zero": [{"wall_s": 12.0}, {"wall_s": 10.0}], "moderate": [{"wall_s": 11.5}],
                     "heavy": [{"wall_s": 40.0}, {"wall_s": 30.0}]},
            "arpo": {"zero": [{"wall_s": 20.0}], "moderate": [{"wall_s": 25.0}], "heavy": [{"wall_s": 29.0}]}}
    s = summarize(runs)
    assert s["aepo"]["zero"]["vs_zero"] == 1.0 and s["aepo"]["zero"]["met"] is None
    assert s["aepo"]["moderate"]["vs_zero"] == pytest.approx(1.15) and s["aepo"]["moderate"]["met"]
    assert s["aepo"]["heavy"]["wall_s"] == 30.0 and s["aepo"]["heavy"]["vs_zero"] == 3.0  # the best repetition
    assert not s["aepo"]["heavy"]["met"]
    assert s["arpo"]["moderate"]["vs_zero"] == 1.25 and not s["arpo"]["moderate"]["met"]
    assert s["arpo"]["heavy"]["vs_zero"] == 1.45 and s["arpo"]["heavy"]["met"]
