"""SQLite tool-result cache: round trips, normalized keys, hit/miss counters, no lost updates under 8 writer
processes and 8 writer threads, and the CachedTool wrapper (errors are never cached)."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path

from aepo_core.interfaces import Tool, ToolResult
from infra.tools.cache import CachedTool, ToolResultCache, normalize_argument

# Spawned writer processes import this module: keep its imports light (the registry test imports its own).

WRITERS = 8
KEYS_PER_WRITER = 40


def test_put_get_round_trip_and_normalized_keys(tmp_path: Path) -> None:
    cache = ToolResultCache(tmp_path / "cache.sqlite")
    assert cache.get("search", "bm25", "Capital of France") is None
    cache.put("search", "bm25", "Capital of France", "Page 1: Paris", {"hits": 1})
    entry = cache.get("search", "bm25", "  capital   of FRANCE ")
    assert entry is not None and entry.text == "Page 1: Paris" and entry.meta == {"hits": 1}
    assert cache.get("search", "replay", "Capital of France") is None  # the backend is part of the key
    cache.put("search", "bm25", "capital of france", "Page 1: Paris, France")  # replaces
    assert cache.get("search", "bm25", "Capital of France").text == "Page 1: Paris, France"  # type: ignore[union-attr]
    assert len(cache) == 1

    cache.put("python", "sandbox", "print('A')\n", "A")
    assert cache.get("python", "sandbox", "\nprint('A')   \n\n") is not None
    assert cache.get("python", "sandbox", "print('a')") is None  # code keeps its case
    assert normalize_argument("python", "  x = 1\n") == "x = 1"


def test_hit_and_miss_counters_in_process_and_persisted(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    cache = ToolResultCache(path)
    cache.get("search", "bm25", "q1")
    cache.put("search", "bm25", "q1", "r1")
    cache.get("search", "bm25", "q1")
    cache.get("search", "bm25", "Q1")
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.puts) == (2, 1, 1) and abs(stats.hit_rate - 2 / 3) < 1e-9

    other = ToolResultCache(path)  # another process or run sees the persisted totals
    assert other.stats().hits == 0
    other.get("search", "bm25", "missing")
    persisted = other.persisted_stats()
    assert (persisted.hits, persisted.misses, persisted.puts) == (2, 2, 1)
    assert other.persisted_stats("python").puts == 0
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _write_many(path: str, writer: int, start: threading.Barrier | None = None) -> None:
    """One writer: distinct keys, the shared key every time, and a read per key."""
    cache = ToolResultCache(path)
    if start is not None:
        start.wait(timeout=60)  # all writers hit the file at the same moment
    for i in range(KEYS_PER_WRITER):
        cache.put("search", "bm25", f"writer {writer} key {i}", f"value {writer}-{i}")
        cache.put("search", "bm25", "shared key", f"shared from {writer}")
        cache.get("search", "bm25", f"writer {writer} key {i}")
    cache.close()


def _assert_no_lost_updates(path: Path) -> None:
    cache = ToolResultCache(path)
    for writer in range(WRITERS):
        for i in range(KEYS_PER_WRITER):
            entry = cache.get("search", "bm25", f"writer {writer} key {i}")
            assert entry is not None and entry.text == f"value {writer}-{i}"
    shared = cache.get("search", "bm25", "shared key")
    assert shared is not None and shared.text in {f"shared from {w}" for w in range(WRITERS)}
    assert len(cache) == WRITERS * KEYS_PER_WRITER + 1
    persisted = cache.persisted_stats()
    assert persisted.puts == 2 * WRITERS * KEYS_PER_WRITER  # every counter increment survived too
    assert persisted.hits == 2 * WRITERS * KEYS_PER_WRITER + 1  # writers' reads + the checks above


def test_concurrent_writer_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_write_many, args=(str(path), w, start)) for w in range(WRITERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    _assert_no_lost_updates(path)


def test_concurrent_writer_threads_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    shared_cache = ToolResultCache(path)  # one object used by all threads: one connection per thread inside
    errors: list[BaseException] = []

    def run(writer: int) -> None:
        try:
            for i in range(KEYS_PER_WRITER):
                shared_cache.put("search", "bm25", f"writer {writer} key {i}", f"value {writer}-{i}")
                shared_cache.put("search", "bm25", "shared key", f"shared from {writer}")
                shared_cache.get("search", "bm25", f"writer {writer} key {i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert shared_cache.stats().puts == 2 * WRITERS * KEYS_PER_WRITER
    _assert_no_lost_updates(path)


class _CountingTool:
    """A real (tiny) tool: upper-cases its argument; fails on arguments starting with 'fail'."""

    name = "search"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, argument: str) -> ToolResult:
        self.calls += 1
        if argument.startswith("fail"):
            return ToolResult(text="Search failed: upstream down", ok=False, error="transient_error")
        return ToolResult(text=argument.upper(), meta={"backend": "counting"})


def test_cached_tool_sets_cache_hit_and_skips_errors(tmp_path: Path) -> None:
    inner = _CountingTool()
    tool = CachedTool(inner, ToolResultCache(tmp_path / "cache.sqlite"), backend="bm25")
    assert isinstance(tool, Tool) and tool.name == "search"

    first = tool("paris facts")
    second = tool("Paris   facts")
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert first.text == second.text == "PARIS FACTS" and second.meta["backend"] == "counting"
    assert inner.calls == 1

    for _ in range(2):
        failed = tool("fail please")
        assert not failed.ok and not failed.cache_hit
    assert inner.calls == 3  # the error was not cached
    assert tool.cache.stats().puts == 1


def test_build_tools_wraps_search_in_the_cache(tmp_path: Path) -> None:
    from aepo_core.tool_config import ToolsConfig
    from infra.tools.registry import build_tools
    from infra.tools.sandbox.tool import PythonSandbox

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "1", "title": "Paris", "text": "Paris is the capital of France."}\n'
                      '{"id": "2", "title": "Rome", "text": "Rome is the capital of Italy."}\n', encoding="utf-8")
    cfg = ToolsConfig.model_validate({"search": {"backend": "bm25", "corpus": str(corpus)}, "timeout_s": 5.0})
    tools = build_tools(cfg, tmp_path / "runs")
    assert set(tools) == {"search", "python"}
    assert isinstance(tools["search"], CachedTool) and isinstance(tools["python"], PythonSandbox)
    assert all(isinstance(t, Tool) for t in tools.values())
    first, second = tools["search"]("capital of Italy"), tools["search"]("capital of italy")
    assert first.text.startswith("Page 1: Rome: ") and (first.cache_hit, second.cache_hit) == (False, True)
    assert (tmp_path / "runs" / "tool_cache.sqlite").is_file() and any((tmp_path / "runs" / "indexes").iterdir())
    assert tools["python"]("6 * 7").text == "42"

    uncached = build_tools(cfg.model_copy(update={"cache": False}), tmp_path / "runs2")
    assert not isinstance(uncached["search"], CachedTool)
    python_cached = build_tools(cfg.model_copy(update={"cache_python": True}), tmp_path / "runs3")
    assert isinstance(python_cached["python"], CachedTool)
