"""rollout.scheduling per_question and per_path (issue 56 §2): a question (per_path: a path) whose tool calls are
back generates while the others' calls run, and its tree is the one the round loop samples — with tool calls of
random latency (so they complete in shuffled orders), in every mode, with and without the probe kept, and across
repeated runs. The engine is the scripted one (its samples do not depend on their batch); the test is not vacuous:
the overlapped runs call the engine with other batches than the round loop (checked), so only their ordering of
decisions and nodes keeps the trees equal."""

from __future__ import annotations

import random
import threading
import time

import pytest
from scripted_engine import ScriptedEngine, random_script

from aepo_core.config import RolloutConfig
from aepo_core.interfaces import ToolResult
from aepo_core.rollout.overlap import PerPathScheduler, PerQuestionScheduler, scheduler_class
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.rollout.tree import RolloutTree

BASE = dict(k=8, initial_rollouts=4, beam_size=2, gamma=0.2, tau=0.5, entropy_window=20, max_tool_calls=3,
            max_response_tokens=4000)
QUESTIONS = [Question(f"q{i}", [ord(c) for c in f"Q{i}: what is x?\n"]) for i in range(24)]


class SlowSearch:
    """A search whose calls take 0-20 ms at random (not seeded: completion orders differ run to run); one query of
    one question's paths can be made slow (``slow``) so the others must go on without it."""

    name = "search"

    def __init__(self, max_delay_s: float = 0.02) -> None:
        self.max_delay_s = max_delay_s
        self.rng = random.Random()
        self.lock = threading.Lock()

    def __call__(self, argument: str) -> ToolResult:
        with self.lock:
            delay = self.rng.uniform(0.0, self.max_delay_s)
        time.sleep(delay)
        return ToolResult(f"Page 1: doc about {argument}")


def signature(trees: list[RolloutTree]) -> list[tuple[object, ...]]:
    """Everything a tree holds that sampling and the rules decide: the nodes and their decisions, m, the leaves."""
    return [(t.question_id, t.global_budget,
             tuple((n.parent_id, n.kind, tuple(n.token_ids), n.branched, n.branch_reason, n.delta_entropy,
                    n.consecutive_branches) for n in t.nodes),
             tuple((leaf.leaf_id, tuple(leaf.node_ids), leaf.sample_kind, leaf.status, leaf.branch_steps)
                   for leaf in t.leaves)) for t in trees]


CONFIGS = {
    "aepo, probe discarded": dict(mode="aepo", probe="discard", branch_penalty=0.05),
    "aepo, probe kept": dict(mode="aepo", probe="reuse", branch_penalty=0.05, beta=0.5),
    "aepo, official budget": dict(mode="aepo", budget_rule="official"),
    "arpo": dict(mode="arpo"),
    "independent": dict(mode="independent"),
}


@pytest.mark.parametrize("scheduler", [PerQuestionScheduler, PerPathScheduler])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_question_and_per_path_trees_are_the_round_loop_s(name: str, scheduler: type[RolloutScheduler]) -> None:
    cfg = RolloutConfig(**BASE, **CONFIGS[name])
    rounds_engine = ScriptedEngine(random_script)
    rounds = RolloutScheduler(rounds_engine, {"search": SlowSearch(0.0)}, cfg).run(QUESTIONS, seed=3)
    expected = signature(rounds.trees)
    assert any(n.branched for t in rounds.trees for n in t.nodes) or cfg.mode == "independent"
    for _ in range(2):  # twice: completion orders differ between the runs
        engine = ScriptedEngine(random_script)
        run = scheduler(engine, {"search": SlowSearch()}, cfg).run(QUESTIONS, seed=3)
        assert signature(run.trees) == expected
        assert run.stats["leaves"] == rounds.stats["leaves"] and run.stats["tokens_generated"] == \
            rounds.stats["tokens_generated"]
        assert engine.calls != rounds_engine.calls  # other batches: the questions did not move in lockstep


@pytest.mark.parametrize("scheduler", [PerQuestionScheduler, PerPathScheduler])
def test_a_slow_question_does_not_hold_the_others_back(scheduler: type[RolloutScheduler]) -> None:
    """One question's every call takes 0.5 s; the rest answer at once. The others finish their trees while it
    waits: the engine is called for them between its rounds (in the round loop every call waits for it)."""

    class OneSlow(SlowSearch):
        def __call__(self, argument: str) -> ToolResult:
            time.sleep(0.5 if argument.startswith("slow") else 0.0)
            return ToolResult(f"Page 1: doc about {argument}")

    def script(transcript: str, seed: int):
        seg = random_script(transcript, seed)
        return type(seg)(seg.text.replace("<search>", "<search>slow") if transcript.startswith("Q0:") else seg.text,
                         seg.entropy, seg.eos)

    cfg = RolloutConfig(**BASE, mode="arpo")
    engine = ScriptedEngine(script)
    res = scheduler(engine, {"search": OneSlow()}, cfg).run(QUESTIONS[:6], seed=0)
    rounds_engine = ScriptedEngine(script)
    rounds = RolloutScheduler(rounds_engine, {"search": OneSlow()}, cfg).run(QUESTIONS[:6], seed=0)
    assert signature(res.trees) == signature(rounds.trees)
    slow_rounds = max(sum(1 for n in t.nodes if n.kind == "tool") for t in res.trees[:1])
    assert slow_rounds >= 1
    # the five fast questions' work went out in more, smaller calls than the round loop's lockstep
    assert len(engine.calls) > len(rounds_engine.calls)
    assert res.stats["tools_s"] < rounds.stats["tools_s"]  # waited only when nothing else could run


def test_the_config_picks_the_scheduler() -> None:
    assert scheduler_class("rounds") is RolloutScheduler and scheduler_class("per_question") is PerQuestionScheduler
    assert scheduler_class("per_path") is PerPathScheduler
    assert RolloutConfig().scheduling == "rounds"


class SlowServer(ScriptedEngine):
    """The scripted engine as a server: each call takes 0-10 ms at random, calls run concurrently (the most at once
    is recorded), so segments come back in shuffled orders."""

    def __init__(self) -> None:
        super().__init__(random_script)
        self.rng, self.lock = random.Random(), threading.Lock()
        self.in_flight = self.most_in_flight = 0

    def generate(self, requests, sampling):  # type: ignore[no-untyped-def]
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            delay = self.rng.uniform(0.0, 0.01)
        time.sleep(delay)
        try:
            return super().generate(requests, sampling)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_requests_sent_path_by_path_give_the_round_loop_s_trees(name: str) -> None:
    """rollout.inflight_requests: each ready path's segment is a request of its own, many in flight; segments and
    tool results come back in any order, and the trees are still the round loop's."""
    cfg = RolloutConfig(**BASE, **CONFIGS[name])
    expected = signature(RolloutScheduler(ScriptedEngine(random_script), {"search": SlowSearch(0.0)}, cfg)
                         .run(QUESTIONS, seed=3).trees)
    server = SlowServer()
    run = PerPathScheduler(server, {"search": SlowSearch()}, cfg.model_copy(update={
        "scheduling": "per_path", "inflight_requests": 16})).run(QUESTIONS, seed=3)
    assert signature(run.trees) == expected
    # One request a call, several at once (the official budget rule's root samples go first, as one batch).
    segments = server.calls[1:] if cfg.budget_rule == "official" else server.calls
    assert set(segments) == {1} and server.most_in_flight > 1
    # the engine's time counts calls out together once: a share of the wall time, not a sum over threads
    assert 0 < run.stats["generate_s"] <= run.stats["wall_s"]
