"""The common budget of a training run: what each step spent, and the running total.

Arms that branch spend different tokens and tool calls per step, so a curve over steps alone favours whichever arm
spends more. Every run therefore logs, per step and cumulatively, the same spend in the same units, and the curves
and comparison tables can put Pass@1 and reward against cumulative generated tokens as well as against steps.

- ``generated_tokens``: tokens the engine sampled (every round of the step, DAPO refills included; tokens cut
  later by a stop string included: the engine did that work).
- ``prompt_tokens``: prompt tokens sent with each generation request (the transcript so far). A prefix cache (vLLM's,
  or the HF engine's KV reuse) skips the prefill of some of them: this is the work an engine without one would do,
  the same on every engine.
- ``tool_calls``: real tool calls by tool name (the scheduler's notices, e.g. a call past the limit, excluded).
- ``rollout_cpu_s`` / ``update_cpu_s``: CPU seconds of the phase, summed over the processes doing it (the trainer,
  its finished children such as sandboxed code, a managed vLLM server) and over data-parallel ranks.
- ``gpu_s``: wall seconds of the phase × GPUs held; 0 on a CPU-only run (and then not logged).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from aepo_core.rollout.tree import RolloutTree

COST_PREFIX = "cost/"
TOTAL = "total_"
"""``cost/<name>`` is the step's spend, ``cost/total_<name>`` the run's so far (through that step)."""


@dataclass(frozen=True)
class Spend:
    """What some steps spent (see the module docstring for each field); ``a + b`` adds two spends."""

    generated_tokens: float = 0.0
    prompt_tokens: float = 0.0
    tool_calls: Mapping[str, int] = field(default_factory=dict)
    rollout_cpu_s: float = 0.0
    update_cpu_s: float = 0.0
    gpu_s: float = 0.0

    def __add__(self, other: Spend) -> Spend:
        calls = dict(self.tool_calls)
        for name, n in other.tool_calls.items():
            calls[name] = calls.get(name, 0) + n
        return Spend(self.generated_tokens + other.generated_tokens, self.prompt_tokens + other.prompt_tokens,
                     calls, self.rollout_cpu_s + other.rollout_cpu_s, self.update_cpu_s + other.update_cpu_s,
                     self.gpu_s + other.gpu_s)

    def values(self) -> dict[str, float]:
        """Flat values: every scalar field, ``cpu_s`` (rollout + update), ``tool_calls`` (all tools) and
        ``tool_calls_<tool>`` per tool; ``gpu_s`` only when a GPU was held."""
        out = {"generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
               "tool_calls": float(sum(self.tool_calls.values())),
               **{f"tool_calls_{name}": float(n) for name, n in sorted(self.tool_calls.items())},
               "rollout_cpu_s": self.rollout_cpu_s, "update_cpu_s": self.update_cpu_s,
               "cpu_s": self.rollout_cpu_s + self.update_cpu_s}
        if self.gpu_s > 0:
            out["gpu_s"] = self.gpu_s
        return out

    def state_dict(self) -> dict[str, object]:
        """JSON-able, for a checkpoint (a resumed run's totals go on from the checkpoint's)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object]) -> Spend:
        unknown = set(state) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"spend state has unknown fields {sorted(unknown)}")
        calls = state.get("tool_calls", {})
        if not isinstance(calls, Mapping):
            raise ValueError(f"spend state: tool_calls must be a mapping, got {calls!r}")
        scalars = {f.name: float(state[f.name]) for f in fields(cls)  # type: ignore[arg-type]
                   if f.name != "tool_calls" and f.name in state}
        if any(not math.isfinite(v) or v < 0 for v in scalars.values()):
            raise ValueError(f"spend state has a negative or non-finite value: {scalars}")
        return cls(tool_calls={str(k): int(v) for k, v in calls.items()}, **scalars)


def tool_calls_by_tool(trees: Sequence[RolloutTree], names: Sequence[str] = ()) -> dict[str, int]:
    """Real tool calls in ``trees`` by tool name (notices excluded), 0 for each of ``names`` not called (so that
    every step logs every tool). A branch's shared prefix is one node: a call is counted once however many leaves
    descend from it, as it ran once."""
    calls: dict[str, int] = dict.fromkeys(names, 0)
    for tree in trees:
        for node in tree.nodes:
            if node.tool is not None and not node.tool.is_notice:
                calls[node.tool.name] = calls.get(node.tool.name, 0) + 1
    return calls


def cost_metrics(step: Spend, total: Spend) -> dict[str, float]:
    """``cost/<name>`` (the step) and ``cost/total_<name>`` (the run through that step)."""
    return {**{f"{COST_PREFIX}{k}": v for k, v in step.values().items()},
            **{f"{COST_PREFIX}{TOTAL}{k}": v for k, v in total.values().items()}}
