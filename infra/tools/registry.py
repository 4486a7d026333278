"""Build the agent's tools from config: the one place that knows which tool classes exist."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aepo_core.interfaces import Tool
from aepo_core.tool_config import ToolsConfig

from .cache import CachedTool, ToolResultCache
from .latency import DelayedTool, latency_model
from .sandbox.tool import PythonSandbox
from .search import Bm25Backend, SearchTool, build_search_tool

logger = logging.getLogger(__name__)


def build_tools(
    cfg: ToolsConfig, runs_dir: str | os.PathLike[str], documents: Iterable[Mapping[str, Any]] | None = None
) -> dict[str, Tool]:
    """``{"search": …, "python": …}`` for the enabled tools, behind the SQLite cache when ``cfg.cache``.

    ``documents`` (e.g. the synthetic task's corpus) are indexed with BM25 when no corpus is configured.

    A tool with a ``latency`` waits that long per call (:class:`DelayedTool`), under the cache.

    Defaults under ``runs_dir``: the BM25 index cache in ``indexes/`` and the result cache in
    ``tool_cache.sqlite``. Python results are cached only with ``cfg.cache_python`` (code may be random).
    """
    runs = Path(runs_dir)
    tools: dict[str, Tool] = {}
    search: SearchTool | None = None
    if cfg.search.enabled:
        tools["search"] = search = build_search_tool(
            cfg.search,
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            workers=cfg.workers,
            index_dir=runs / "indexes",
            backend=Bm25Backend(documents, cfg.search.index_dir or runs / "indexes")
            if documents is not None and not cfg.search.corpus and cfg.search.backend == "bm25"
            else None,
        )
    if cfg.python.enabled:
        sandbox = PythonSandbox(cfg.python, timeout_s=cfg.timeout_s)
        caps = sandbox.capabilities
        if cfg.python.isolate_network and not caps.network_isolated:
            logger.warning("python tool runs WITHOUT network isolation: %s", "; ".join(caps.notes))
        tools["python"] = sandbox
    for name, tool_cfg in (("search", cfg.search), ("python", cfg.python)):
        if name in tools and tool_cfg.latency.kind != "none":  # inside the cache: a hit comes back without the wait
            tools[name] = DelayedTool(tools[name], latency_model(tool_cfg.latency, name))
    if cfg.cache and tools:
        cache = ToolResultCache(cfg.cache_path or runs / "tool_cache.sqlite")
        if search is not None:
            # The cache key names the corpus too: two corpora in one runs dir must not share results.
            corpus = search.backend.corpus_key()
            key = f"{cfg.search.backend}:{corpus}" if corpus is not None else cfg.search.backend
            tools["search"] = CachedTool(tools["search"], cache, backend=key)
        if "python" in tools and cfg.cache_python:
            tools["python"] = CachedTool(tools["python"], cache, backend="sandbox")
    return tools
