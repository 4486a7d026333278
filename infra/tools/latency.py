"""A tool whose calls wait as a real tool's would (issue 56 §1): :class:`aepo_core.tool_latency.LatencyModel`'s delay,
slept before the call, so that the cost of waiting on tools is measurable with the offline ones."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from aepo_core.config_keys import ConfigError
from aepo_core.interfaces import Tool, ToolResult
from aepo_core.tool_config import ToolLatencyConfig
from aepo_core.tool_latency import LatencyModel


class DelayedTool:
    """``tool`` behind a delay: each call sleeps the model's delay for (its argument, how many calls with this argument
    came before), then runs; the result's ``latency_s`` includes the wait (its meta does not name it: the cache keeps
    a result's meta, and a hit does not wait)."""

    def __init__(self, tool: Tool, model: LatencyModel) -> None:
        self.tool = tool
        self.model = model
        self.name = tool.name
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, argument: str) -> ToolResult:
        wait = self.next_delay(argument)
        started = time.perf_counter()
        time.sleep(wait)
        result = self.tool(argument)
        return replace(result, latency_s=time.perf_counter() - started)

    def next_delay(self, argument: str) -> float:
        """The delay of the next call with ``argument`` (its occurrence counted, thread-safely)."""
        with self._lock:
            occurrence = self._seen[argument]
            self._seen[argument] += 1
        return self.model.delay(self.name, argument, occurrence)


def latency_model(cfg: ToolLatencyConfig, tool: str) -> LatencyModel:
    """The model ``cfg`` describes; ``replay`` reads its file (:func:`load_latencies`)."""
    recorded = load_latencies(Path(cfg.replay_file), tool) if cfg.kind == "replay" and cfg.replay_file else ()
    return LatencyModel(cfg.kind, cfg.mean_s, cfg.p99_s, recorded, cfg.seed)


def load_latencies(path: Path, tool: str) -> tuple[float, ...]:
    """Recorded latencies in seconds: a JSON list, or one number per line (blank lines and ``#`` comments skipped).
    A missing file, an entry that is not a number ≥ 0, or none at all: :class:`ConfigError` naming the file and row."""
    where = f"tools.{tool}.latency.replay_file {path}"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    if text.lstrip().startswith("["):
        try:
            rows = list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON list ({exc})") from None
    else:
        rows = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1)
                if line.strip() and not line.lstrip().startswith("#")]
    out = []
    for n, value in rows:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise ConfigError(f"{where}: row {n}: {value!r} is not a latency in seconds (a number ≥ 0)")
        out.append(seconds)
    if not out:
        raise ConfigError(f"{where}: no latencies")
    return tuple(out)
