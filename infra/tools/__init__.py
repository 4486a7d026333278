"""The agent's tools: search (BM25 / replay / HTTP), a Python sandbox, and a SQLite result cache.

Each implements :class:`aepo_core.interfaces.Tool`: text in, :class:`~aepo_core.interfaces.ToolResult` out,
errors as results. ``build_tools(cfg, runs_dir)`` (in :mod:`.registry`) makes them from ``ToolsConfig``.
Exports are imported lazily so light users (e.g. cache workers) do not load the search stack.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "build_tools": "registry",
    "SearchTool": "search",
    "build_search_tool": "search",
    "PythonSandbox": "sandbox.tool",
    "sandbox_capabilities": "sandbox.capabilities",
    "ToolResultCache": "cache",
    "CachedTool": "cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
