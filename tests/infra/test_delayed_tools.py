"""Tools that wait (issue 56 §1): the real BM25 search behind a delay through build_tools — the wait happens, is
recorded, sits under the cache, and a run of the same calls repeats it; recorded latencies read with errors that
name the file and row."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aepo_core.config_keys import ConfigError
from aepo_core.interfaces import Tool, ToolResult
from aepo_core.tool_config import ToolLatencyConfig, ToolsConfig
from infra.tools.cache import CachedTool
from infra.tools.latency import DelayedTool, latency_model, load_latencies
from infra.tools.registry import build_tools


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "1", "title": "Paris", "text": "Paris is the capital of France."}\n'
                      '{"id": "2", "title": "Rome", "text": "Rome is the capital of Italy."}\n', encoding="utf-8")
    return corpus


def test_a_delayed_search_waits_under_the_cache(tmp_path: Path) -> None:
    cfg = ToolsConfig.model_validate({"search": {"backend": "bm25", "corpus": str(_corpus(tmp_path)),
                                                 "latency": {"kind": "fixed", "mean_s": 1.0}},
                                      "python": {"enabled": False}, "timeout_s": 5.0})
    tools = build_tools(cfg, tmp_path / "runs")
    search = tools["search"]
    assert isinstance(search, CachedTool) and isinstance(search.tool, DelayedTool) and isinstance(search, Tool)
    t0 = time.perf_counter()
    miss = search("capital of Italy")
    waited = time.perf_counter() - t0
    assert miss.text.startswith("Page 1: Rome: ") and not miss.cache_hit
    assert waited >= 1.0 and miss.latency_s >= 1.0  # the sleep happened and is in the result's latency
    hit = search("capital of Italy")
    assert hit.cache_hit and hit.latency_s < 1.0  # a cached result comes back without the wait
    uncached = build_tools(cfg.model_copy(update={"cache": False}), tmp_path / "runs2")["search"]
    assert isinstance(uncached, DelayedTool) and uncached("capital of France").latency_s >= 1.0


def test_the_same_calls_wait_the_same_in_another_run() -> None:
    class Echo:
        name = "search"

        def __call__(self, argument: str) -> ToolResult:
            return ToolResult(argument)

    cfg = ToolLatencyConfig(kind="lognormal", mean_s=0.001, p99_s=0.01, seed=5)
    model = latency_model(cfg, "search")
    calls = ("a", "b", "a", "c", "a")
    expected = [model.delay("search", q, n) for q, n in zip(calls, (0, 0, 1, 0, 2), strict=True)]
    for _ in range(2):  # two runs of the same calls
        tool = DelayedTool(Echo(), model)
        assert [tool.next_delay(q) for q in calls] == expected
    assert len(set(expected)) == 5  # a repeated argument is another call, with its own delay
    tool = DelayedTool(Echo(), model)
    assert all(tool(q).latency_s >= wait for q, wait in zip(calls, expected, strict=True))


def test_recorded_latencies_and_their_errors(tmp_path: Path) -> None:
    lines = tmp_path / "lat.txt"
    lines.write_text("# seconds\n0.4\n\n2.5\n")
    assert load_latencies(lines, "search") == (0.4, 2.5)
    listed = tmp_path / "lat.json"
    listed.write_text("[1, 0.25]")
    model = latency_model(ToolLatencyConfig(kind="replay", replay_file=str(listed)), "search")
    assert model.recorded == (1.0, 0.25) and model.delay("search", "q", 0) in (1.0, 0.25)
    for text, message in (("0.4\nslow\n", "row 2: 'slow'"), ("[1, -2]", "row 2: -2"), ("# none\n", "no latencies"),
                          ("[1,", "not a JSON list")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message) as err:
            load_latencies(bad, "python")
        assert f"tools.python.latency.replay_file {bad}" in str(err.value)
    with pytest.raises(ConfigError, match=r"missing\.txt"):
        load_latencies(tmp_path / "missing.txt", "search")
