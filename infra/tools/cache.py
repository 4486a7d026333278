"""SQLite cache of tool results, shared by threads and processes without lost updates.

One row per (tool, backend, normalized argument); WAL journal so readers never block the writer, a busy
timeout so concurrent writers wait instead of failing, one connection per thread (and per process: a
connection is never reused after ``fork``). Writes are single ``INSERT OR REPLACE`` transactions (the published
code rewrote a whole JSON file per query and lost updates). Hit/miss counters are kept in-process and persisted
in a ``stats`` table with atomic ``UPDATE … + 1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from aepo_core.interfaces import Tool, ToolResult

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    tool TEXT NOT NULL,
    backend TEXT NOT NULL,
    key TEXT NOT NULL,
    argument TEXT NOT NULL,
    text TEXT NOT NULL,
    meta TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (tool, backend, key)
);
CREATE TABLE IF NOT EXISTS stats (
    tool TEXT NOT NULL,
    backend TEXT NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    misses INTEGER NOT NULL DEFAULT 0,
    puts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tool, backend)
);
"""


def normalize_argument(tool: str, argument: str) -> str:
    """Cache-key form of an argument: search queries are case/space-folded; code only loses outer blank space
    and trailing spaces (case and indentation matter in code)."""
    if tool == "search":
        return " ".join(argument.lower().split())
    return "\n".join(line.rstrip() for line in argument.strip("\n").splitlines()).strip()


@dataclass(frozen=True)
class CacheEntry:
    text: str
    meta: dict[str, object]
    created: float


@dataclass(frozen=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ToolResultCache:
    """Thread- and process-safe SQLite store of successful tool results."""

    def __init__(self, path: str | os.PathLike[str], busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._puts = 0
        conn = self._conn()
        deadline = time.monotonic() + busy_timeout_s
        while True:  # switching to WAL needs a moment of exclusive access; it then persists in the file
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.executescript(_SCHEMA)
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=True)
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection, reopened after a fork (a connection must not cross processes)."""
        pid = os.getpid()
        if getattr(self._local, "pid", None) != pid:
            self._local.conn = self._connect()
            self._local.pid = pid
        return self._local.conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")  # take the write lock up front: no lock upgrade, no deadlock
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @staticmethod
    def key(tool: str, argument: str) -> str:
        return hashlib.sha256(normalize_argument(tool, argument).encode()).hexdigest()

    def _count(self, tool: str, backend: str, column: str) -> None:
        with self._lock:
            setattr(self, f"_{column}", getattr(self, f"_{column}") + 1)
        self._conn().execute(
            f"INSERT INTO stats (tool, backend, {column}) VALUES (?, ?, 1) "
            f"ON CONFLICT (tool, backend) DO UPDATE SET {column} = {column} + 1",
            (tool, backend),
        )

    def get(self, tool: str, backend: str, argument: str) -> CacheEntry | None:
        """The stored result, counting a hit or a miss (in this process and in the file)."""
        row = self._conn().execute(
            "SELECT text, meta, created FROM results WHERE tool = ? AND backend = ? AND key = ?",
            (tool, backend, self.key(tool, argument)),
        ).fetchone()
        self._count(tool, backend, "hits" if row is not None else "misses")
        if row is None:
            return None
        return CacheEntry(text=row[0], meta=json.loads(row[1]), created=row[2])

    def put(self, tool: str, backend: str, argument: str, text: str, meta: dict[str, object] | None = None) -> None:
        """Store (or replace) a result; the row and the put counter change in one transaction."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO results (tool, backend, key, argument, text, meta, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (tool, backend, self.key(tool, argument), normalize_argument(tool, argument), text,
                 json.dumps(meta or {}, default=str), time.time()),
            )
            conn.execute(
                "INSERT INTO stats (tool, backend, puts) VALUES (?, ?, 1) "
                "ON CONFLICT (tool, backend) DO UPDATE SET puts = puts + 1",
                (tool, backend),
            )
        with self._lock:
            self._puts += 1

    def stats(self) -> CacheStats:
        """Counters of this process (this object)."""
        with self._lock:
            return CacheStats(self._hits, self._misses, self._puts)

    def persisted_stats(self, tool: str | None = None) -> CacheStats:
        """Counters summed over every process that used the file (optionally for one tool)."""
        sql = "SELECT COALESCE(SUM(hits), 0), COALESCE(SUM(misses), 0), COALESCE(SUM(puts), 0) FROM stats"
        params: tuple[str, ...] = ()
        if tool is not None:
            sql += " WHERE tool = ?"
            params = (tool,)
        hits, misses, puts = self._conn().execute(sql, params).fetchone()
        return CacheStats(hits, misses, puts)

    def __len__(self) -> int:
        return int(self._conn().execute("SELECT COUNT(*) FROM results").fetchone()[0])

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            conn.close()
        self._local = threading.local()


class CachedTool:
    """A tool behind the cache: hits skip the call (``cache_hit=True``); only successful results are stored.

    Cache trouble (a locked or broken database) is logged and the tool is called as if uncached.
    """

    def __init__(self, tool: Tool, cache: ToolResultCache, backend: str = "default") -> None:
        self.tool = tool
        self.cache = cache
        self.backend = backend
        self.name = tool.name

    def __call__(self, argument: str) -> ToolResult:
        started = time.perf_counter()
        try:
            entry = self.cache.get(self.name, self.backend, argument)
        except sqlite3.Error as exc:
            logger.warning("tool cache read failed (%s); calling %s", exc, self.name)
            entry = None
        if entry is not None:
            return ToolResult(text=entry.text, ok=True, latency_s=time.perf_counter() - started, cache_hit=True,
                              meta={**entry.meta, "cached_at": entry.created})
        try:
            result = self.tool(argument)
        except Exception as exc:  # tools should not raise; if one does, it is still a result
            logger.exception("tool %s raised", self.name)
            return ToolResult(text=f"Tool {self.name} failed: {type(exc).__name__}: {exc}", ok=False,
                              error="tool_exception", latency_s=time.perf_counter() - started)
        if result.ok:
            try:
                self.cache.put(self.name, self.backend, argument, result.text, dict(result.meta))
            except sqlite3.Error as exc:
                logger.warning("tool cache write failed (%s) for %s", exc, self.name)
        return replace(result, cache_hit=False)
