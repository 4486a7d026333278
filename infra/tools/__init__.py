"""The agent's tools: search (BM25 / replay / HTTP), a Python sandbox, and a SQLite result cache.

Each implements :class:`aepo_core.interfaces.Tool`: text in, :class:`~aepo_core.interfaces.ToolResult` out,
errors as results. ``build_tools(cfg, runs_dir)`` (in :mod:`.registry`) makes them from ``ToolsConfig``.
Import each from its module (this package re-exports nothing).
"""
