"""Protocols that infra implements and the algorithm core consumes.

The core never imports an implementation; engines, tools and reward functions are handed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "eos", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One row of a batched generation: continue ``prompt_ids`` until a stop string, EOS or ``max_tokens``.

    Stop strings are matched in the generated tokens only, never in ``prompt_ids``: one that a caller's segment
    cap split (``</se`` at the end of the prompt, ``arch>`` generated) goes unnoticed by the engine.  The rollout
    scheduler finds it in the whole turn and cuts the segment there, the same way for every engine.
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    stop: Sequence[str] = ()
    seed: int | None = None


@dataclass(frozen=True)
class GenerationResult:
    """What the engine produced for one row.

    ``entropies`` are per-position entropies (nats) of the temperature-scaled distribution that each token was
    sampled from; ``entropy_is_estimate`` is True when they come from top-k log-probs (remote engines).
    ``weight_version`` is the label of the weights that sampled the tokens as a server reported it (the RL step
    after a weight sync); None where the engine does not track versions (the in-process engine samples from the
    trainer's own weights).
    ``published_entropies`` are the published code's per-position terms (top-10 truncated entropy ÷ ln|V|,
    :func:`aepo_core.entropy.published_token_entropy`), read only under ``rollout.entropy_scale: official``;
    None where the engine does not report them.
    """

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None
    entropy_is_estimate: bool = False
    error: str | None = None
    weight_version: str | None = None
    published_entropies: list[float] | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How each token is drawn; ``published_entropy``: also report the published code's top-10 entropy terms
    (``GenerationResult.published_entropies``, read under ``rollout.entropy_scale: official``). Off, an engine that
    pays for them per token (the in-process one: a top-10 of every [rows, vocabulary] step, ~2.7 ms at 48 rows ×
    49 152 on a 2-core Zen 4) skips them and reports None."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    published_entropy: bool = False


@runtime_checkable
class Engine(Protocol):
    """Token-in/token-out batched generation."""

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        ...

    def encode(self, text: str) -> list[int]:
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        ...

    @property
    def eos_token_id(self) -> int | None:
        ...


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer: always text. Errors are results too (``ok=False``), never exceptions."""

    text: str
    ok: bool = True
    error: str | None = None
    latency_s: float = 0.0
    cache_hit: bool = False
    meta: dict[str, object] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """A tool the agent can call by tag (``<search>…</search>``, ``<python>…</python>``)."""

    name: str

    def __call__(self, argument: str) -> ToolResult:
        ...


@dataclass(frozen=True)
class RewardResult:
    score: float
    reason: str
    details: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RewardFn(Protocol):
    """Scores one trajectory.  ``response_text`` is the whole transcript (model segments and tool results: the
    format check and the tool calls read it); ``model_text`` is only what the model wrote, where the answer is
    read, so a tool result (a search snippet) can never supply it.  ``model_text=None``: the transcript with its
    ``<result>`` blocks removed."""

    def __call__(self, response_text: str, golds: Sequence[str], tool_names: Sequence[str] = (), *,
                 model_text: str | None = None) -> RewardResult:
        ...
