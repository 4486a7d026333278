"""Build the agent's tools from config: the one place that knows which tool classes exist."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from aepo_core.config import ToolsConfig
from aepo_core.interfaces import Tool

from .cache import CachedTool, ToolResultCache
from .python_sandbox import PythonSandbox
from .search import build_search_tool

logger = logging.getLogger(__name__)


def build_tools(cfg: ToolsConfig, runs_dir: str | os.PathLike[str]) -> dict[str, Tool]:
    """``{"search": …, "python": …}`` for the enabled tools, behind the SQLite cache when ``cfg.cache``.

    Defaults under ``runs_dir``: the BM25 index cache in ``indexes/`` and the result cache in
    ``tool_cache.sqlite``. Python results are cached only with ``cfg.cache_python`` (code may be random).
    """
    runs = Path(runs_dir)
    tools: dict[str, Tool] = {}
    if cfg.search.enabled:
        tools["search"] = build_search_tool(
            cfg.search,
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            workers=cfg.workers,
            index_dir=runs / "indexes",
        )
    if cfg.python.enabled:
        sandbox = PythonSandbox.from_config(cfg.python, timeout_s=cfg.timeout_s)
        caps = sandbox.capabilities
        if cfg.python.isolate_network and not caps.network_isolated:
            logger.warning("python tool runs WITHOUT network isolation: %s", "; ".join(caps.notes))
        tools["python"] = sandbox
    if cfg.cache and tools:
        cache = ToolResultCache(cfg.cache_path or runs / "tool_cache.sqlite")
        if "search" in tools:
            tools["search"] = CachedTool(tools["search"], cache, backend=cfg.search.backend)
        if "python" in tools and cfg.cache_python:
            tools["python"] = CachedTool(tools["python"], cache, backend="sandbox")
    return tools
