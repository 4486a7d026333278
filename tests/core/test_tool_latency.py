"""The tool latency model (issue 56 §1): each shape's closed form, its draws' statistics, and delays that depend on
(seed, tool, argument, occurrence) alone."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import build_config
from aepo_core.tool_latency import LOGNORMAL_MAX_TAIL, LatencyModel, lognormal_params, uniform


def test_lognormal_from_mean_and_p99() -> None:
    """mean 3 s, p99 20 s (issue 56's heavy tail): σ solves σ²/2 − 2.326σ + ln(20/3) = 0 → 1.0545, μ = ln 3 − σ²/2;
    the closed forms give back the mean and the p99; the widest tail is exp(2.326²/2) ≈ 14.97 × the mean."""
    mu, sigma = lognormal_params(3.0, 20.0)
    assert sigma == pytest.approx(1.05448, abs=1e-4) and mu == pytest.approx(math.log(3) - sigma**2 / 2)
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(3.0)
    assert math.exp(mu + 2.3263479 * sigma) == pytest.approx(20.0, rel=1e-6)
    assert LOGNORMAL_MAX_TAIL == pytest.approx(14.9685, abs=1e-3)
    for mean, p99 in ((1.0, 1.0), (1.0, 0.5), (0.0, 2.0), (1.0, 15.5)):
        with pytest.raises(ValueError):
            lognormal_params(mean, p99)


def test_draws_have_the_mean_and_p99_asked_for() -> None:
    m = LatencyModel("lognormal", 3.0, 20.0, seed=7)
    xs = sorted(m.delay("search", f"query {i}", 0) for i in range(100_000))
    assert statistics.fmean(xs) == pytest.approx(3.0, rel=0.03)
    assert xs[99_000] == pytest.approx(20.0, rel=0.06)
    assert xs[50_000] == pytest.approx(math.exp(lognormal_params(3.0, 20.0)[0]), rel=0.03)  # the median e^μ


def test_a_delay_depends_on_its_call_not_on_the_order_calls_run() -> None:
    m = LatencyModel("lognormal", 1.0, 5.0, seed=3)
    calls = [("search", f"q{i % 7}", i // 7) for i in range(50)]
    first = {c: m.delay(*c) for c in calls}
    shuffled = calls[:]
    random.Random(0).shuffle(shuffled)
    assert {c: m.delay(*c) for c in shuffled} == first
    assert len(set(first.values())) == len(calls)  # argument and occurrence both count
    assert m.delay("python", "q0", 0) != m.delay("search", "q0", 0)
    assert LatencyModel("lognormal", 1.0, 5.0, seed=4).delay("search", "q0", 0) != first[("search", "q0", 0)]
    assert 0 < uniform(0, "a") < 1 and uniform(0, "a") == uniform(0, "a")


def test_fixed_replay_and_none() -> None:
    assert LatencyModel("fixed", 0.25).delay("search", "x", 3) == 0.25
    assert LatencyModel().delay("search", "x", 0) == 0.0
    recorded = (0.5, 1.5, 9.0)
    replay = LatencyModel("replay", recorded=recorded, seed=1)
    drawn = [replay.delay("search", f"q{i}", 0) for i in range(300)]
    assert set(drawn) == set(recorded)  # each recorded latency comes up, nothing else
    with pytest.raises(ValueError, match="recorded"):
        LatencyModel("replay")
    with pytest.raises(ValueError, match="kind"):
        LatencyModel("gamma")


@pytest.mark.parametrize(("sets", "message"), [
    (["tools.search.latency.kind=fixed"], "mean_s > 0"),
    (["tools.search.latency.kind=lognormal", "tools.search.latency.mean_s=1"], "p99_s"),
    (["tools.python.latency.kind=lognormal", "tools.python.latency.mean_s=1", "tools.python.latency.p99_s=20"],
     "14.97"),
    (["tools.search.latency.kind=replay"], "replay_file"),
])
def test_an_incomplete_latency_is_a_config_error(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(ExperimentConfig().to_dict(), sets)
    ok = build_config(ExperimentConfig().to_dict(), ["tools.search.latency.kind=lognormal",
                                                     "tools.search.latency.mean_s=3", "tools.search.latency.p99_s=20"])
    assert ok.tools.search.latency.p99_s == 20 and ok.tools.python.latency.kind == "none"
