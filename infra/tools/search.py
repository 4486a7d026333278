"""The agent's search tool and its backends.

Backends answer ``search(query, top_k, timeout_s) -> SearchResponse``; :class:`SearchTool` wraps one backend with
what every tool owes the rollout loop: a wall timeout, bounded retries for transient errors only, and a text
result in the paper's format (``Page 1: {title}: {snippet}``), errors included.

- ``bm25``: a BM25 index (``bm25s``) over a local corpus, cached on disk under a key hashed from the corpus.
- ``replay``: recorded results (``search_cache.json`` of ARPO): exact, then normalized query match, falling back
  to BM25 over the recorded snippets.
- ``http``: a Serper-like JSON POST web-search API; the key comes from an environment variable, never a file.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import json
import logging
import os
import random
import re
import socket
import threading
import time
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import bm25s
from bm25s.stopwords import STOPWORDS_EN

from aepo_core.interfaces import ToolResult
from aepo_core.tool_config import SearchToolConfig
from infra.atomic import atomic_dir

# bm25s sets its own logger to DEBUG at import ("Building index from tokens" on every index build, past the
# application's WARNING); NOTSET hands the decision back to the logging configuration (``aepo -v``).
logging.getLogger("bm25s").setLevel(logging.NOTSET)

logger = logging.getLogger(__name__)

# Bump when tokenization or the on-disk layout changes: it is part of the index cache key.
INDEX_FORMAT_VERSION = "bm25s-v1"
_TOKEN_RE = re.compile(r"\w+", re.UNICODE)
_STOPWORDS = frozenset(STOPWORDS_EN)
_PAGE_SPLIT_RE = re.compile(r"(?:^|\n)Page \d+:[ \t]*")
_TRANSIENT_HTTP_CODES = frozenset({408, 425, 429, 500, 502, 503, 504})


# --------------------------------------------------------------------------------------------------------------
# Data types and errors
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchHit:
    """One retrieved page; ``text`` is the full text (the tool cuts the snippet around the query terms)."""

    text: str
    title: str = ""
    url: str | None = None
    doc_id: str | None = None
    score: float | None = None


@dataclass(frozen=True)
class SearchResponse:
    hits: list[SearchHit]
    meta: dict[str, object] = field(default_factory=dict)


class SearchError(Exception):
    """A permanent search failure: retrying cannot help. ``code`` becomes ``ToolResult.error``."""

    def __init__(self, message: str, code: str = "backend_error") -> None:
        super().__init__(message)
        self.code = code


class TransientSearchError(SearchError):
    """A failure that may pass (timeout, connection error, 429/5xx): the tool retries it with backoff."""

    def __init__(self, message: str, code: str = "transient_error") -> None:
        super().__init__(message, code)


@runtime_checkable
class SearchBackend(Protocol):
    name: str

    def search(self, query: str, top_k: int, timeout_s: float) -> SearchResponse:
        ...

    def corpus_key(self) -> str | None:
        """The key of the corpus searched (the result cache keeps two corpora apart by it); None: no local
        corpus (the web)."""
        ...


# --------------------------------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------------------------------


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without English stopwords: the same for documents and queries."""
    return [t for t in _TOKEN_RE.findall(text.lower()) if t not in _STOPWORDS]


def normalize_query(query: str) -> str:
    """Case-, whitespace- and punctuation-folded query, so trivially different spellings hit the same entry."""
    folded = unicodedata.normalize("NFKC", query).lower()
    return " ".join(re.sub(r"[\W_]+", " ", folded).split())


def make_snippet(text: str, query: str, max_chars: int) -> str:
    """Whitespace-collapsed window of ``text`` of at most ``max_chars`` holding the most query-term occurrences."""
    text = " ".join(text.split())
    if len(text) <= max_chars:
        return text
    terms = set(tokenize(query))
    lowered = text.lower()
    positions = [m.start() for m in _TOKEN_RE.finditer(lowered) if m.group() in terms]
    start = 0
    if positions:
        best = -1
        for pos in positions:
            candidate = max(0, pos - max_chars // 4)
            count = sum(1 for p in positions if candidate <= p < candidate + max_chars)
            if count > best:
                best, start = count, candidate
        start = min(start, max(0, len(text) - max_chars))
        if start > 0:  # begin at a word boundary
            space = text.find(" ", start)
            start = space + 1 if 0 <= space < start + 20 else start
    prefix = "…" if start > 0 else ""
    budget = max_chars - len(prefix)
    window = text[start : start + budget]
    if start + budget < len(text):
        window = window[: max(1, budget - 1)].rstrip() + "…"
    return prefix + window


def format_hits(hits: Sequence[SearchHit], query: str, snippet_chars: int) -> str:
    """The paper's result format: one ``Page i: {title}: {snippet}`` line per hit."""
    lines = []
    for i, hit in enumerate(hits, 1):
        snippet = make_snippet(hit.text, query, snippet_chars)
        title = " ".join(hit.title.split())
        lines.append(f"Page {i}: {title}: {snippet}" if title else f"Page {i}: {snippet}")
    return "\n".join(lines)


def split_pages(recorded: str) -> list[str]:
    """Pages of a recorded result ``"Page 1: …\\nPage 2: …"``; a text without markers yields no pages."""
    if not _PAGE_SPLIT_RE.match(recorded):
        return []
    return [p.strip() for p in _PAGE_SPLIT_RE.split(recorded) if p.strip()]


# --------------------------------------------------------------------------------------------------------------
# Corpus and BM25 index
# --------------------------------------------------------------------------------------------------------------


def load_documents(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Documents as ``{"id", "title", "text"}`` dicts from a list of dicts or a JSONL/JSON/Parquet file."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows: Iterable[Mapping[str, Any]] = pq.read_table(path).to_pylist()
        elif path.suffix == ".json":
            rows = json.loads(path.read_text(encoding="utf-8"))
        else:
            with path.open(encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
    else:
        rows = source
    docs = []
    for i, row in enumerate(rows):
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"document {i} has no 'text' string (keys: {sorted(row)})")
        docs.append({"id": str(row.get("id", i)), "title": str(row.get("title") or ""), "text": text})
    return docs


def corpus_hash(docs: Sequence[Mapping[str, str]]) -> str:
    """Stable key of a corpus (and the index format) for the on-disk index cache."""
    digest = hashlib.sha256(INDEX_FORMAT_VERSION.encode())
    for doc in docs:
        digest.update(json.dumps([doc["id"], doc["title"], doc["text"]], ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:24]


class Bm25Index:
    """BM25 over ``title + text``, built once per corpus and reloaded from ``index_dir/bm25-<hash>``.

    ``loaded_from_disk`` says whether this instance reused a cached index. Building writes to a temporary
    directory that is renamed into place, so concurrent builders never leave a half-written index.
    """

    def __init__(self, docs: Sequence[Mapping[str, str]], index_dir: str | os.PathLike[str] | None = None) -> None:
        if not docs:
            raise ValueError("cannot build a BM25 index over an empty corpus")
        self.docs = [dict(d) for d in docs]
        self.key = corpus_hash(self.docs)
        self.path = Path(index_dir) / f"bm25-{self.key}" if index_dir is not None else None
        self.loaded_from_disk = False
        self._lock = threading.Lock()
        self._retriever = self._load() if self.path is not None and self.path.is_dir() else None
        if self._retriever is None:
            self._retriever = self._build()
        else:
            self.loaded_from_disk = True

    def _load(self) -> bm25s.BM25 | None:
        assert self.path is not None
        try:
            retriever = bm25s.BM25.load(str(self.path), show_progress=False, verbosity=0)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("BM25 index at %s is unreadable (%s); rebuilding", self.path, exc)
            return None
        logger.info("loaded BM25 index %s (%d docs)", self.path, len(self.docs))
        return retriever

    def _build(self) -> bm25s.BM25:
        started = time.perf_counter()
        retriever = bm25s.BM25()
        retriever.index([tokenize(f"{d['title']} {d['text']}") for d in self.docs], show_progress=False)
        logger.info("built BM25 index over %d docs in %.2fs", len(self.docs), time.perf_counter() - started)
        if self.path is not None:
            try:  # another process that stores its index first wins (and ours stays in memory)
                with atomic_dir(self.path) as staging:
                    retriever.save(str(staging), show_progress=False)
                    (staging / "format.json").write_text(
                        json.dumps({"format": INDEX_FORMAT_VERSION, "docs": len(self.docs)}), encoding="utf-8"
                    )
            except OSError as exc:  # the disk refused: keep ours in memory
                logger.info("BM25 index not stored at %s: %s", self.path, exc)
        return retriever

    def search(self, query: str, top_k: int) -> list[SearchHit]:
        vocab = self._retriever.vocab_dict
        tokens = [t for t in tokenize(query) if t in vocab]
        if not tokens:
            return []
        k = min(top_k, len(self.docs))
        with self._lock:
            ids, scores = self._retriever.retrieve([tokens], k=k, show_progress=False)
        hits = []
        for idx, score in zip(ids[0].tolist(), scores[0].tolist(), strict=False):
            if score <= 0.0:
                continue
            doc = self.docs[idx]
            hits.append(SearchHit(text=doc["text"], title=doc["title"], doc_id=doc["id"], score=float(score)))
        return hits


# --------------------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------------------


class Bm25Backend:
    """Local BM25 search over a document corpus."""

    name = "bm25"

    def __init__(
        self,
        corpus: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.index = Bm25Index(load_documents(corpus), index_dir)

    def search(self, query: str, top_k: int, timeout_s: float) -> SearchResponse:
        return SearchResponse(self.index.search(query, top_k), {"match": "bm25"})

    def corpus_key(self) -> str | None:
        return self.index.key


class ReplaySearchBackend:
    """Recorded results: exact query, then normalized query, then BM25 over every recorded snippet.

    An exact or normalized match returns what was recorded (including a recorded "no results").
    """

    name = "replay"

    def __init__(
        self,
        cache: str | os.PathLike[str] | Mapping[str, str],
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(cache, Mapping):
            recorded = dict(cache)
        else:
            recorded = json.loads(Path(cache).read_text(encoding="utf-8"))
        if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
            raise ValueError("a replay cache must be a JSON object {query: 'Page 1: …'}")
        self.recorded: dict[str, str] = recorded
        self.normalized: dict[str, str] = {}
        for query in recorded:
            self.normalized.setdefault(normalize_query(query), query)
        docs, seen = [], set()
        for i, (_query, text) in enumerate(recorded.items()):
            for j, page in enumerate(split_pages(text)):
                if page not in seen:
                    seen.add(page)
                    docs.append({"id": f"{i}:{j + 1}", "title": "", "text": page})
        self.index = Bm25Index(docs, index_dir) if docs else None

    def _recorded_hits(self, query: str, top_k: int) -> list[SearchHit]:
        return [SearchHit(text=page) for page in split_pages(self.recorded[query])[:top_k]]

    def search(self, query: str, top_k: int, timeout_s: float) -> SearchResponse:
        if query in self.recorded:
            return SearchResponse(self._recorded_hits(query, top_k), {"match": "exact"})
        original = self.normalized.get(normalize_query(query))
        if original is not None:
            return SearchResponse(self._recorded_hits(original, top_k), {"match": "normalized", "recorded": original})
        hits = self.index.search(query, top_k) if self.index is not None else []
        return SearchResponse(hits, {"match": "bm25"})

    def corpus_key(self) -> str | None:
        return self.index.key if self.index is not None else None


class HttpSearchBackend:
    """Serper-like web search: POST ``{"q", "num"}`` with the key in a header; reads ``organic`` results.

    Timeouts, connection errors and HTTP 408/425/429/5xx raise :class:`TransientSearchError` (retried by the
    tool); other HTTP errors and malformed answers raise :class:`SearchError` (not retried).
    """

    name = "http"

    def __init__(
        self,
        url: str,
        api_key_env: str,
        request_timeout_s: float = 10.0,
        api_key_header: str = "X-API-KEY",
    ) -> None:
        self.url = url
        self.api_key_env = api_key_env
        self.request_timeout_s = request_timeout_s
        self.api_key_header = api_key_header

    def search(self, query: str, top_k: int, timeout_s: float) -> SearchResponse:
        api_key = os.environ.get(self.api_key_env, "")
        if not api_key:
            raise SearchError(f"the search API key is not set (environment variable {self.api_key_env})", "no_api_key")
        body = json.dumps({"q": query, "num": top_k}).encode()
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", self.api_key_header: api_key},
        )
        timeout = max(0.05, min(self.request_timeout_s, timeout_s))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            detail = f"HTTP {exc.code} from search API"
            if exc.code in _TRANSIENT_HTTP_CODES:
                raise TransientSearchError(detail, f"http_{exc.code}") from None
            raise SearchError(detail, f"http_{exc.code}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            code = "timeout" if isinstance(reason, (TimeoutError, socket.timeout)) else "connection_error"
            raise TransientSearchError(f"search API unreachable: {reason}", code) from None
        try:
            data = json.loads(payload)
            organic = data.get("organic", [])
            hits = [
                SearchHit(
                    text=str(item.get("snippet") or ""),
                    title=str(item.get("title") or ""),
                    url=item.get("link"),
                )
                for item in organic[:top_k]
                if isinstance(item, dict)
            ]
        except (ValueError, AttributeError, TypeError) as exc:
            raise SearchError(f"malformed search API response: {exc}", "bad_response") from None
        return SearchResponse(hits, {"match": "http"})

    def corpus_key(self) -> str | None:
        return None


# --------------------------------------------------------------------------------------------------------------
# The tool
# --------------------------------------------------------------------------------------------------------------


class SearchTool:
    """The ``<search>`` tool: one backend behind a wall timeout, transient-only retries and text results.

    The backend runs in a worker thread so a slow backend cannot hold the rollout past ``timeout_s``
    (the thread itself is left to finish; HTTP requests carry their own socket timeout).
    """

    name = "search"

    def __init__(
        self,
        backend: SearchBackend,
        cfg: SearchToolConfig,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        workers: int = 8,
    ) -> None:
        """``cfg``: results and retry backoff (``tools.search``; its backend fields are ``build_search_backend``'s);
        ``timeout_s``, ``max_retries``, ``workers``: what every tool call shares (``tools.*``)."""
        self.backend = backend
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="search")

    def _error(self, code: str, message: str, started: float, **meta: object) -> ToolResult:
        logger.info("search error %s: %s", code, message)
        return ToolResult(
            text=f"Search failed: {message}",
            ok=False,
            error=code,
            latency_s=time.perf_counter() - started,
            meta={"backend": self.backend.name, **meta},
        )

    def __call__(self, argument: str) -> ToolResult:
        started = time.perf_counter()
        query = " ".join(argument.split())
        if not query:
            return self._error("empty_query", "the query is empty; write the query between <search> and </search>.",
                               started)
        deadline = started + self.timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return self._error("timeout", f"no answer within {self.timeout_s:g}s", started, attempts=attempt)
            attempt += 1
            future = self._executor.submit(self.backend.search, query, self.cfg.top_k, remaining)
            try:
                response = future.result(timeout=remaining)
            except concurrent.futures.TimeoutError:
                future.cancel()
                return self._error("timeout", f"no answer within {self.timeout_s:g}s", started, attempts=attempt)
            except TransientSearchError as exc:
                delay = self.cfg.retry_backoff_s * (2 ** (attempt - 1)) * (1.0 + 0.25 * random.random())
                if attempt > self.max_retries or time.perf_counter() + delay >= deadline:
                    return self._error(exc.code, f"{exc} (after {attempt} attempts)", started, attempts=attempt)
                logger.info("transient search error (%s), retry %d in %.2fs", exc, attempt, delay)
                time.sleep(delay)
                continue
            except SearchError as exc:
                return self._error(exc.code, str(exc), started, attempts=attempt)
            except Exception as exc:  # a backend bug must not kill the rollout: it becomes an error result
                logger.exception("search backend %s raised", self.backend.name)
                return self._error("backend_error", f"{type(exc).__name__}: {exc}", started, attempts=attempt)
            break
        hits = response.hits[: self.cfg.top_k]
        text = format_hits(hits, query, self.cfg.snippet_chars) if hits else f"No results found for '{query}'."
        meta: dict[str, object] = {"backend": self.backend.name, "hits": len(hits), "attempts": attempt}
        meta.update(response.meta)
        return ToolResult(text=text, ok=True, latency_s=time.perf_counter() - started, meta=meta)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def build_search_backend(
    cfg: SearchToolConfig, index_dir: str | os.PathLike[str] | None = None
) -> SearchBackend:
    """The backend named by ``cfg.backend``; ``cfg.index_dir`` wins over the ``index_dir`` default."""
    index_dir = cfg.index_dir or index_dir
    if cfg.backend == "http":
        if not cfg.http_url:
            raise ValueError("tools.search.http_url is required for the http search backend")
        if not os.environ.get(cfg.http_api_key_env):
            logger.warning("environment variable %s is empty: http search calls will fail", cfg.http_api_key_env)
        return HttpSearchBackend(cfg.http_url, cfg.http_api_key_env, cfg.http_request_timeout_s)
    if not cfg.corpus:
        raise ValueError(f"tools.search.corpus is required for the {cfg.backend} search backend")
    if cfg.backend == "replay":
        return ReplaySearchBackend(cfg.corpus, index_dir)
    return Bm25Backend(cfg.corpus, index_dir)


def build_search_tool(
    cfg: SearchToolConfig,
    *,
    timeout_s: float = 30.0,
    max_retries: int = 2,
    workers: int = 8,
    index_dir: str | os.PathLike[str] | None = None,
    backend: SearchBackend | None = None,
) -> SearchTool:
    """A :class:`SearchTool` from config (``backend`` overrides the configured one, e.g. a prebuilt corpus)."""
    return SearchTool(
        backend if backend is not None else build_search_backend(cfg, index_dir),
        cfg,
        timeout_s=timeout_s,
        max_retries=max_retries,
        workers=workers,
    )
