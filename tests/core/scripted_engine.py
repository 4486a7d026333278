"""A deterministic engine for scheduler tests: characters are tokens, the script decides each segment."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams, ToolResult

EOS = 0
SCRIPTED_VOCAB = 1000


@dataclass
class Segment:
    text: str
    entropy: float
    eos: bool = False


Script = Callable[[str, int], Segment]  # (transcript so far, seed) → next segment


def tool_then_answer(calls: int, h_first: float, h_after_tool: Sequence[float] | float, tool: str = "search") -> Script:
    """Make ``calls`` tool calls, then answer; entropy h_first on the first segment, h_after_tool[i] after result i."""

    def script(transcript: str, seed: int) -> Segment:
        n = transcript.count("<result>")
        h = h_first if n == 0 else (h_after_tool if isinstance(h_after_tool, float) else h_after_tool[n - 1])
        if n < calls:
            return Segment(f"<think>step {n}</think><{tool}>q{n}</{tool}>", h)
        return Segment("<think>done</think><answer>\\boxed{x}</answer>", h)

    return script


def random_script(transcript: str, seed: int) -> Segment:
    """Random per segment seed: an entropy in [0.5, 4) and, for the first three turns, a search call with probability
    0.75; the text carries the seed, so two paths share a transcript only when they sampled the same segments."""
    rng = random.Random(seed)
    n = transcript.count("<result>")
    h = rng.uniform(0.5, 4.0)
    if n < 3 and rng.random() < 0.75:
        return Segment(f"<think>{seed % 1_000_003} {n}</think><search>q{n}</search>", h)
    return Segment(f"<think>{seed % 1_000_003}</think><answer>\\boxed{{x}}</answer>", h)


@dataclass
class ScriptedEngine:
    script: Script
    fail_when: Callable[[str], bool] = lambda transcript: False
    calls: list[int] = field(default_factory=list)  # batch sizes seen

    @property
    def eos_token_id(self) -> int:
        return EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != EOS)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        self.calls.append(len(requests))
        out = []
        for req in requests:
            transcript = self.decode(req.prompt_ids)
            if self.fail_when(transcript):
                out.append(GenerationResult([], [], [], "error", error="scripted failure"))
                continue
            seg = self.script(transcript, req.seed or 0)
            ids = self.encode(seg.text) + ([EOS] if seg.eos else [])
            finish, stop = ("eos", None) if seg.eos else ("length", None)
            for s in req.stop:
                if not seg.eos and seg.text.endswith(s):
                    finish, stop = "stop", s
            if len(ids) > req.max_tokens:
                ids, finish, stop = ids[: req.max_tokens], "length", None
            # the published code's per-position terms: on a scale of their own (÷ SCRIPTED_VOCAB's log)
            published = [seg.entropy / math.log(SCRIPTED_VOCAB)] * len(ids)
            out.append(GenerationResult(ids, [-0.5] * len(ids), [seg.entropy] * len(ids), finish, stop,
                                        published_entropies=published))
        return out


class EchoSearch:
    """A search tool whose result names the query; chosen queries fail, raise or hang (deterministically); every
    call takes at least ``delay_s``."""

    name = "search"

    def __init__(self, fail: set[str] = frozenset(), raise_on: set[str] = frozenset(),
                 hang_on: set[str] = frozenset(), hang_s: float = 5.0, delay_s: float = 0.0) -> None:
        self.fail, self.raise_on, self.hang_on, self.hang_s = set(fail), set(raise_on), set(hang_on), hang_s
        self.delay_s = delay_s

    def __call__(self, argument: str) -> ToolResult:
        if argument in self.raise_on:
            raise RuntimeError("backend exploded")
        time.sleep(self.hang_s if argument in self.hang_on else self.delay_s)
        if argument in self.fail:
            return ToolResult("search failed: backend unavailable", ok=False, error="unavailable")
        return ToolResult(f"Page 1: doc about {argument}")
