"""Latency added to tool calls (issue 56 §1): what a call to a real tool would have waited, drawn reproducibly.

A delay depends on (seed, tool, argument, occurrence) alone, through a hash, never on which call ran first: the same
run repeats its delays whatever the thread timing. Three shapes: a fixed delay; a log-normal set by its mean and 99th
percentile (a web-search API: most calls near the median, a few many times slower); a replay of recorded latencies.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

Z99 = NormalDist().inv_cdf(0.99)
LOGNORMAL_MAX_TAIL = math.exp(Z99 * Z99 / 2)
"""The largest p99 / mean a log-normal has (≈ 14.97): with mean exp(μ + σ²/2) and p99 exp(μ + z₀.₉₉σ), the ratio
exp(z₀.₉₉σ − σ²/2) peaks at σ = z₀.₉₉."""


def lognormal_params(mean_s: float, p99_s: float) -> tuple[float, float]:
    """(μ, σ) of the log-normal with this mean and 99th percentile: σ solves σ²/2 − z₀.₉₉σ + ln(p99/mean) = 0 (the
    smaller root, the tail that puts the mean below the p99), μ = ln(mean) − σ²/2."""
    if not (mean_s > 0 and mean_s < p99_s <= LOGNORMAL_MAX_TAIL * mean_s * (1 + 1e-12)):
        raise ValueError(f"a log-normal needs 0 < mean < p99 <= {LOGNORMAL_MAX_TAIL:.2f} × mean; got mean "
                         f"{mean_s}, p99 {p99_s}")
    sigma = Z99 - math.sqrt(max(0.0, Z99 * Z99 - 2 * math.log(p99_s / mean_s)))
    return math.log(mean_s) - sigma * sigma / 2, sigma


def uniform(seed: int, *key: str | int) -> float:
    """A uniform draw in (0, 1) from ``seed`` and ``key`` alone (BLAKE2b; the same on every machine and run)."""
    digest = hashlib.blake2b("\0".join(map(str, (seed, *key))).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


@dataclass(frozen=True)
class LatencyModel:
    """Seconds a call waits: ``fixed`` (``mean_s``), ``lognormal`` (μ, σ from ``mean_s`` and ``p99_s``) or
    ``replay`` (one of ``recorded``, picked by the hash), or ``none`` (0)."""

    kind: str = "none"
    mean_s: float = 0.0
    p99_s: float | None = None
    recorded: Sequence[float] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind == "lognormal":
            lognormal_params(self.mean_s, self.p99_s or 0.0)  # checks the pair
        if self.kind == "replay" and not self.recorded:
            raise ValueError("a replay latency model needs recorded latencies")
        if self.kind not in ("none", "fixed", "lognormal", "replay"):
            raise ValueError(f"unknown latency kind {self.kind!r}")

    def delay(self, tool: str, argument: str, occurrence: int) -> float:
        """The delay of the ``occurrence``-th call (0-based) of ``tool`` with ``argument``."""
        if self.kind == "none":
            return 0.0
        if self.kind == "fixed":
            return self.mean_s
        u = uniform(self.seed, tool, argument, occurrence)
        if self.kind == "replay":
            return float(self.recorded[min(int(u * len(self.recorded)), len(self.recorded) - 1)])
        mu, sigma = lognormal_params(self.mean_s, self.p99_s or 0.0)
        return math.exp(mu + sigma * NormalDist().inv_cdf(u))
