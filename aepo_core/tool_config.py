"""The agent's tools in the config tree (``tools:``): search and the Python sandbox."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from aepo_core.config_section import Section
from aepo_core.tool_latency import LOGNORMAL_MAX_TAIL


class ToolLatencyConfig(Section):
    """Latency added to each call of a tool, so that the cost of waiting on real tools (a web-search API: 0.5-3 s, a
    page fetch with a reader model: 5-30 s) can be measured with the offline ones (issue 56). Each call's delay is
    drawn from (seed, tool, argument, how many times this argument was called before), never from the order calls
    run in, so a run repeats its delays. The delay counts towards ``tools.timeout_s``; a cached result comes back
    without it (a cache hit of a real API is fast too): turn ``tools.cache`` off to delay every call."""

    kind: Literal["none", "fixed", "lognormal", "replay"] = Field(
        "none",
        description="none: no added delay; fixed: mean_s every call; lognormal: a log-normal with mean mean_s and "
        "99th percentile p99_s (heavy tails: most calls fast, a few very slow); replay: a recorded latency from "
        "replay_file per call.",
    )
    mean_s: float = Field(0.0, ge=0.0, description="fixed: the delay; lognormal: the mean delay, in seconds.")
    p99_s: float | None = Field(
        None, gt=0.0, description=f"lognormal: the 99th percentile in seconds, above mean_s and at most "
        f"{LOGNORMAL_MAX_TAIL:.2f} × mean_s (a log-normal's widest tail for a given mean).",
    )
    replay_file: str | None = Field(
        None, description="replay: recorded latencies in seconds, a JSON list or one number per line."
    )
    seed: int = Field(0, description="Seed of the draws (with the tool's name, the argument and its occurrence).")

    @model_validator(mode="after")
    def _complete(self) -> ToolLatencyConfig:
        if self.kind == "fixed" and self.mean_s <= 0:
            raise ValueError("latency kind fixed needs mean_s > 0")
        if self.kind == "lognormal":
            p99 = self.p99_s or 0.0
            if self.mean_s <= 0 or not self.mean_s < p99 <= LOGNORMAL_MAX_TAIL * self.mean_s:
                raise ValueError(f"latency kind lognormal needs mean_s > 0 and mean_s < p99_s <= "
                                 f"{LOGNORMAL_MAX_TAIL:.2f} × mean_s; got mean_s={self.mean_s}, p99_s={self.p99_s}")
        if self.kind == "replay" and not self.replay_file:
            raise ValueError("latency kind replay needs replay_file")
        return self


class SearchToolConfig(Section):
    """The agent's search tool."""

    enabled: bool = Field(True, description="Offer the search tool to the agent.")
    backend: Literal["bm25", "replay", "http"] = Field(
        "bm25",
        description="bm25: a local BM25 index over corpus; replay: recorded results (ARPO's search_cache.json) "
        "in corpus; http: a Serper-like JSON web-search API at http_url.",
    )
    corpus: str | None = Field(None, description="Documents for bm25 (JSONL/Parquet path) or a replay cache JSON.")
    index_dir: str | None = Field(None, description="Where the BM25 index is cached (default: under the runs dir).")
    top_k: int = Field(3, ge=1, description="Results returned by one search call.")
    snippet_chars: int = Field(400, ge=1, description="Each result's snippet is cut to this many characters.")
    http_url: str | None = Field(None, description="Endpoint of the http backend (required by backend http).")
    http_api_key_env: str = Field("AEPO_SEARCH_API_KEY", description="Environment variable holding the API key.")
    http_request_timeout_s: float = Field(
        10.0, gt=0.0, description="Socket timeout of one HTTP search request (the tool's wall timeout still applies)."
    )
    retry_backoff_s: float = Field(
        0.5, ge=0.0, description="First retry delay for transient search errors; doubles each retry (with jitter)."
    )
    latency: ToolLatencyConfig = Field(default_factory=ToolLatencyConfig, description="Delay added to each call.")


class PythonToolConfig(Section):
    """The agent's Python sandbox: a confined process per call (infra/tools/sandbox/tool.py says how)."""

    enabled: bool = Field(True, description="Offer the Python tool to the agent.")
    cpu_seconds: int = Field(10, ge=1, description="CPU-time limit of each process of a call (RLIMIT_CPU), in seconds.")
    memory_mb: int = Field(
        1024,
        ge=16,
        description="Memory of one call, in MiB: all its processes together and the files it writes (they live in "
        "memory), through a per-call cgroup where the machine allows it; also each process's address space "
        "(RLIMIT_AS).",
    )
    file_size_mb: int = Field(16, ge=1, description="Largest file one call may write (RLIMIT_FSIZE), in MiB.")
    disk_mb: int = Field(
        64,
        ge=1,
        description="Disk space of one call, in MiB: a size-capped tmpfs holding its working directory, /tmp and "
        "/dev/shm together (with the private root; nothing reaches the host's disk). Counts towards memory_mb.",
    )
    max_processes: int = Field(
        64,
        ge=1,
        description="Processes (and threads) of one call together, through a per-call pids cgroup where the "
        "machine allows it; also RLIMIT_NPROC of its uid.",
    )
    cpu_cores: float = Field(
        1.0, gt=0.0, description="CPU bandwidth of one call, in cores (per-call cpu cgroup quota, where available)."
    )
    unconfined: Literal["refuse", "warn"] = Field(
        "refuse",
        description="When this machine cannot confine the code (no mount namespace for the private root, or no "
        "unprivileged uid): 'refuse' returns an error result for every call without running the code; 'warn' "
        "runs it with only rlimits and a host temp dir — the code can then read the host's files, gold answers "
        "included — and logs a warning.",
    )
    max_output_chars: int = Field(
        4000, ge=1, description="stdout and stderr of one call, together, are cut to this many characters."
    )
    isolate_network: bool = Field(True, description="Run under `unshare -n` when the OS allows it.")
    interpreter: str | None = Field(None, description="Python executable for model code (default: the running one).")
    latency: ToolLatencyConfig = Field(default_factory=ToolLatencyConfig, description="Delay added to each call.")
    workdir_root: str | None = Field(
        None,
        description="Parent of the per-call temporary working directories when there is no private root (default: "
        "the system temp dir); with one, the working directory lives in the call's tmpfs.",
    )


class ToolsConfig(Section):
    """The agent's tools and how their calls run."""

    search: SearchToolConfig = Field(default_factory=SearchToolConfig, description="The search tool.")
    python: PythonToolConfig = Field(default_factory=PythonToolConfig, description="The Python sandbox tool.")
    timeout_s: float = Field(30.0, gt=0.0, description="Wall timeout of one tool call.")
    max_retries: int = Field(2, ge=0, description="Retries for transient tool errors only.")
    workers: int = Field(8, ge=1, description="Thread pool size for parallel tool calls.")
    cache: bool = Field(True, description="Cache tool results in SQLite (Python results only with cache_python).")
    cache_path: str | None = Field(None, description="SQLite tool-result cache (default: under the runs dir).")
    cache_python: bool = Field(
        False, description="Also cache Python results; off because model code may be non-deterministic (time, random)."
    )
