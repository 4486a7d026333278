"""Search tool: BM25 retrieval and its on-disk index cache, replay of recorded results, the HTTP client against a
real local server (retries only for transient errors), and errors as results."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from aepo_core.interfaces import Tool
from aepo_core.tool_config import SearchToolConfig
from infra.data.loaders import default_data_root
from infra.tools.search import (
    Bm25Backend,
    HttpSearchBackend,
    ReplaySearchBackend,
    SearchResponse,
    SearchTool,
    build_search_tool,
    make_snippet,
    normalize_query,
    split_pages,
)

REPLAY_CACHE = default_data_root() / "search_cache.json"
API_KEY_ENV = "AEPO_TEST_SEARCH_KEY"

CORPUS = [
    {"id": "eiffel", "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, "
     "France. It was designed by Gustave Eiffel's company and completed in 1889 for the World's Fair."},
    {"id": "statue", "title": "Statue of Liberty", "text": "The Statue of Liberty is a colossal neoclassical "
     "sculpture on Liberty Island in New York Harbor, a gift from the people of France, dedicated in 1886."},
    {"id": "louvre", "title": "Louvre", "text": "The Louvre is the world's most-visited art museum, in Paris. "
     "It houses the Mona Lisa and the Venus de Milo."},
    {"id": "danube", "title": "Danube", "text": "The Danube is the second-longest river in Europe, flowing through "
     "Vienna, Bratislava, Budapest and Belgrade to the Black Sea."},
    {"id": "curie", "title": "Marie Curie", "text": "Marie Curie was a physicist and chemist who conducted "
     "pioneering research on radioactivity; she won Nobel Prizes in physics (1903) and chemistry (1911)."},
    {"id": "tower-bridge", "title": "Tower Bridge", "text": "Tower Bridge is a combined bascule and suspension "
     "bridge in London, built between 1886 and 1894, crossing the River Thames."},
]


def _tool(backend: object, **kwargs: object) -> SearchTool:
    """A tool over ``backend``; keywords that are ``SearchToolConfig`` fields go into its config section."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in SearchToolConfig.model_fields}
    cfg = SearchToolConfig.model_validate(fields)
    return SearchTool(backend, cfg, timeout_s=kwargs.pop("timeout_s", 5.0), **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------- BM25


def test_bm25_finds_the_right_document_among_distractors(tmp_path: Path) -> None:
    tool = _tool(Bm25Backend(CORPUS, tmp_path), top_k=3)
    assert isinstance(tool, Tool)
    result = tool("Who designed the wrought-iron tower completed in 1889?")
    assert result.ok and result.error is None
    assert result.text.startswith("Page 1: Eiffel Tower: The Eiffel Tower is a wrought-iron")
    assert result.meta["backend"] == "bm25" and result.meta["hits"] == 3
    assert [line.split(":")[0] for line in result.text.splitlines()] == ["Page 1", "Page 2", "Page 3"]

    assert tool("radioactivity Nobel physics chemistry").text.startswith("Page 1: Marie Curie: ")
    assert tool("river flowing to the Black Sea").text.startswith("Page 1: Danube: ")


def test_bm25_index_is_cached_on_disk_and_keyed_by_corpus(tmp_path: Path) -> None:
    first = Bm25Backend(CORPUS, tmp_path)
    assert not first.index.loaded_from_disk
    index_dirs = [p.name for p in tmp_path.iterdir()]
    assert index_dirs == [f"bm25-{first.index.key}"]

    second = Bm25Backend(CORPUS, tmp_path)
    assert second.index.loaded_from_disk  # reloaded, not rebuilt
    query = "art museum Mona Lisa"
    assert first.search(query, 3, 1.0).hits == second.search(query, 3, 1.0).hits

    changed = Bm25Backend([*CORPUS, {"id": "x", "title": "New", "text": "a new document"}], tmp_path)
    assert not changed.index.loaded_from_disk and changed.index.key != first.index.key
    assert len(list(tmp_path.iterdir())) == 2


def test_bm25_from_jsonl_via_config_with_top_k_and_snippet_length(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    long_text = "Filler sentence about nothing in particular. " * 40 + "The secret ingredient is saffron. " + (
        "More filler text follows here. " * 40)
    docs = [*CORPUS, {"id": "long", "title": "Recipe", "text": long_text}]
    corpus.write_text("\n".join(json.dumps(d) for d in docs) + "\n", encoding="utf-8")
    cfg = SearchToolConfig(backend="bm25", corpus=str(corpus), top_k=2, snippet_chars=120)
    tool = build_search_tool(cfg, index_dir=tmp_path / "idx")
    result = tool("secret ingredient saffron")
    assert result.ok
    lines = result.text.splitlines()
    assert len(lines) <= 2 and lines[0].startswith("Page 1: Recipe: ")
    snippet = lines[0].removeprefix("Page 1: Recipe: ")
    assert len(snippet) <= 120 and "saffron" in snippet  # the window is around the query terms


def test_snippet_helpers() -> None:
    assert make_snippet("short  text\nhere", "x", 50) == "short text here"
    cut = make_snippet("word " * 200, "nothing", 40)
    assert len(cut) <= 40 and cut.endswith("…")
    assert normalize_query("  Who WROTE 'Hamlet'?! ") == "who wrote hamlet"
    assert split_pages("Page 1: a\nPage 2: b c\nPage 3: d") == ["a", "b c", "d"]
    assert split_pages("No search results found.") == []


def test_empty_query_and_no_results(tmp_path: Path) -> None:
    tool = _tool(Bm25Backend(CORPUS, tmp_path))
    for query in ("", "   \n\t"):
        result = tool(query)
        assert not result.ok and result.error == "empty_query" and "empty" in result.text
    result = tool("zyxxy qwertz")
    assert result.ok and result.text.startswith("No results found") and result.meta["hits"] == 0


class _BrokenBackend:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def search(self, query: str, top_k: int, timeout_s: float) -> SearchResponse:
        self.calls += 1
        raise RuntimeError("index file is corrupt")


class _SlowBackend:
    name = "slow"

    def search(self, query: str, top_k: int, timeout_s: float) -> SearchResponse:
        time.sleep(3.0)
        return SearchResponse([])


def test_backend_that_raises_becomes_an_error_result_without_retry() -> None:
    backend = _BrokenBackend()
    result = _tool(backend, max_retries=3)("anything")
    assert not result.ok and result.error == "backend_error"
    assert "RuntimeError: index file is corrupt" in result.text
    assert backend.calls == 1  # not transient: no retry


def test_wall_timeout_on_a_hanging_backend() -> None:
    started = time.perf_counter()
    result = _tool(_SlowBackend(), timeout_s=0.3)("anything")
    assert time.perf_counter() - started < 2.5  # the backend takes 3 s: only the wall timeout returns sooner
    assert not result.ok and result.error == "timeout"


# --------------------------------------------------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def recorded() -> dict[str, str]:
    return json.loads(REPLAY_CACHE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def replay_tool(recorded: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> SearchTool:
    return _tool(ReplaySearchBackend(REPLAY_CACHE, tmp_path_factory.mktemp("replay-index")), top_k=3,
                 snippet_chars=400)


def _entries_with_pages(recorded: dict[str, str], n: int) -> list[tuple[str, list[str]]]:
    out = []
    for query, text in recorded.items():
        pages = split_pages(text)
        if len(pages) >= 3 and all(len(p) < 350 for p in pages[:3]) and len(normalize_query(query)) > 10:
            out.append((query, pages))
        if len(out) == n:
            break
    return out


def test_replay_exact_match(recorded: dict[str, str], replay_tool: SearchTool) -> None:
    for query, pages in _entries_with_pages(recorded, 3):
        result = replay_tool(query)
        assert result.ok and result.meta["match"] == "exact"
        expected = "\n".join(f"Page {i}: {' '.join(p.split())}" for i, p in enumerate(pages[:3], 1))
        assert result.text == expected


def test_replay_normalized_match(recorded: dict[str, str], replay_tool: SearchTool) -> None:
    for query, pages in _entries_with_pages(recorded, 3):
        variant = "  " + query.upper().replace(" ", "   ") + " ?!"
        assert variant not in recorded
        result = replay_tool(variant)
        assert result.ok and result.meta["match"] == "normalized"
        assert result.text.startswith(f"Page 1: {' '.join(pages[0].split())[:50]}")


def test_replay_falls_back_to_bm25_over_recorded_snippets(recorded: dict[str, str], replay_tool: SearchTool) -> None:
    (_query, pages), *_ = _entries_with_pages(recorded, 1)
    target = " ".join(pages[1].split())
    probe = " ".join(target.rstrip("…. ").split()[:12])  # words of a page, not a recorded query
    assert normalize_query(probe) not in {normalize_query(q) for q in recorded}
    result = replay_tool(probe)
    assert result.ok and result.meta["match"] == "bm25" and result.meta["hits"] >= 1
    assert target[:60] in result.text


def test_replay_backend_rebuilds_nothing_on_second_load(recorded: dict[str, str], tmp_path: Path) -> None:
    subset = dict(list(recorded.items())[:50])
    assert not ReplaySearchBackend(subset, tmp_path).index.loaded_from_disk
    assert ReplaySearchBackend(subset, tmp_path).index.loaded_from_disk


# ----------------------------------------------------------------------------------------------------------- HTTP


class _SearchApi(BaseHTTPRequestHandler):
    """A Serper-like endpoint whose behaviour depends on the query."""

    requests: ClassVar[list[dict[str, object]]] = []
    flaky_failures: ClassVar[dict[str, int]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"body": body, "key": self.headers.get("X-API-KEY")})
        query = body["q"]
        if query.startswith("bad"):
            return self._reply(400, {"message": "Query not allowed"})
        if query.startswith("flaky") and self.flaky_failures.get(query, 0) < 1:
            self.flaky_failures[query] = self.flaky_failures.get(query, 0) + 1
            return self._reply(503, {"message": "busy"})
        if query.startswith("down"):
            return self._reply(503, {"message": "busy"})
        if query.startswith("slow"):
            time.sleep(4.0)
        organic = [
            {"title": f"Result {i} for {query}", "snippet": f"Snippet {i} about {query}.", "link": f"https://x/{i}"}
            for i in range(1, body["num"] + 3)
        ]
        return self._reply(200, {"organic": organic})

    def _reply(self, status: int, payload: dict[str, object]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout test)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture()
def search_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(API_KEY_ENV, "test-key-123")
    _SearchApi.requests = []
    _SearchApi.flaky_failures = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SearchApi)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/search"
    server.shutdown()
    server.server_close()


def _http_tool(url: str, **kwargs: object) -> SearchTool:
    backend = HttpSearchBackend(url, API_KEY_ENV, request_timeout_s=float(kwargs.pop("request_timeout_s", 2.0)))
    kwargs.setdefault("retry_backoff_s", 0.01)
    return _tool(backend, **kwargs)


def test_http_search_formats_results_and_sends_key(search_api: str) -> None:
    result = _http_tool(search_api, top_k=2)("capital of France")
    assert result.ok
    assert result.text == ("Page 1: Result 1 for capital of France: Snippet 1 about capital of France.\n"
                           "Page 2: Result 2 for capital of France: Snippet 2 about capital of France.")
    assert _SearchApi.requests == [{"body": {"q": "capital of France", "num": 2}, "key": "test-key-123"}]


def test_http_transient_503_is_retried(search_api: str) -> None:
    result = _http_tool(search_api, max_retries=2)("flaky question")
    assert result.ok and result.meta["attempts"] == 2
    assert len(_SearchApi.requests) == 2


def test_http_permanent_400_is_not_retried(search_api: str) -> None:
    result = _http_tool(search_api, max_retries=3)("bad question")
    assert not result.ok and result.error == "http_400" and "HTTP 400" in result.text
    assert len(_SearchApi.requests) == 1


def test_http_retries_are_bounded(search_api: str) -> None:
    result = _http_tool(search_api, max_retries=2)("down forever")
    assert not result.ok and result.error == "http_503" and result.meta["attempts"] == 3
    assert len(_SearchApi.requests) == 3


def test_http_slow_server_hits_the_wall_timeout(search_api: str) -> None:
    started = time.perf_counter()
    result = _http_tool(search_api, timeout_s=0.6, request_timeout_s=0.4, max_retries=5)("slow question")
    assert time.perf_counter() - started < 3.0  # the server takes 4 s: only the wall timeout returns sooner
    assert not result.ok and result.error in {"timeout", "transient_error"}


def test_http_connection_refused_is_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "k")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = _http_tool(f"http://127.0.0.1:{port}/search", max_retries=1)("question")
    assert not result.ok and result.error == "connection_error" and result.meta["attempts"] == 2


def test_http_missing_api_key_is_an_error_result(search_api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV)
    result = _http_tool(search_api)("question")
    assert not result.ok and result.error == "no_api_key" and API_KEY_ENV in result.text
    assert _SearchApi.requests == []


def test_build_search_tool_validates_config() -> None:
    with pytest.raises(ValueError, match="http_url"):
        build_search_tool(SearchToolConfig(backend="http"))
    with pytest.raises(ValueError, match="corpus"):
        build_search_tool(SearchToolConfig(backend="bm25"))
