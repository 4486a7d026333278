"""The common budget (aepo_core.cost): per-step and cumulative spend, tool calls by tool, the checkpoint state, and
the prompt tokens the scheduler counts."""

from __future__ import annotations

import pytest
from scripted_engine import EchoSearch, ScriptedEngine, tool_then_answer

from aepo_core.config import RolloutConfig
from aepo_core.cost import Spend, cost_metrics, tool_calls_by_tool
from aepo_core.rollout.scheduler import Question, RolloutScheduler, merge_results

PROMPT = [ord(c) for c in "Q: what is x?\n"]
BASE = dict(k=4, initial_rollouts=2, beam_size=2, gamma=0.2, tau=0.0, branch_penalty=0.0, entropy_window=20,
            max_tool_calls=6, max_response_tokens=2000)


def rollout(mode: str, calls: int, tool: str = "search", n_questions: int = 1):
    cfg = RolloutConfig(mode=mode, **BASE)
    sched = RolloutScheduler(ScriptedEngine(tool_then_answer(calls=calls, h_first=1.0, h_after_tool=4.0, tool=tool)),
                             {"search": EchoSearch(), "python": EchoSearch()}, cfg)
    return sched.run([Question(f"q{i}", PROMPT) for i in range(n_questions)], seed=0)


def test_prompt_tokens_are_each_requests_transcript_so_far():
    res = rollout("independent", calls=1)
    (tree,) = res.trees
    expected = 0
    for leaf in tree.leaves:  # prompt → model → tool → model: two requests per leaf
        prompt, first, result, _last = (len(tree.nodes[i].token_ids) for i in leaf.node_ids)
        expected += prompt + (prompt + first + result)
    assert res.stats["prompt_tokens"] == expected
    generated = sum(len(n.token_ids) for n in tree.nodes if n.kind == "model")
    assert res.stats["tokens_generated"] == generated  # (no stop string cut anything here)
    merged = merge_results([res, rollout("independent", calls=1)])  # two ranks' shards: summed
    assert merged.stats["prompt_tokens"] == 2 * expected


def test_tool_calls_count_each_call_once_however_many_leaves_share_it():
    res = rollout("arpo", calls=2)  # τ = 0: every tool step branches while the budget lasts
    (tree,) = res.trees
    assert res.stats["branch_samples"] > 0
    per_leaf = sum(len(tree.tool_events(leaf)) for leaf in tree.leaves)
    counted = tool_calls_by_tool(res.trees, ["python", "search"])
    assert counted == {"python": 0, "search": sum(1 for n in tree.nodes if n.kind == "tool")}
    assert counted["search"] < per_leaf  # the shared prefixes' calls ran once


def test_notices_are_not_tool_calls():
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1, "max_tool_calls": 1})
    sched = RolloutScheduler(ScriptedEngine(tool_then_answer(calls=3, h_first=1.0, h_after_tool=1.0)),
                             {"search": EchoSearch()}, cfg)
    res = sched.run([Question("q0", PROMPT)], seed=0)
    assert [e.name for e in res.trees[0].tool_events(res.trees[0].leaves[0])][:2] == ["search", "limit"]
    assert tool_calls_by_tool(res.trees) == {"search": 1}


def test_spends_add_and_name_step_and_total():
    a = Spend(100, 400, {"search": 2}, 1.5, 3.0)
    b = Spend(50, 100, {"search": 1, "python": 4}, 0.5, 1.0)
    total = a + b
    assert total == Spend(150, 500, {"search": 3, "python": 4}, 2.0, 4.0)
    m = cost_metrics(b, total)
    assert m["cost/generated_tokens"] == 50 and m["cost/total_generated_tokens"] == 150
    assert m["cost/tool_calls"] == 5 and m["cost/tool_calls_python"] == 4 and m["cost/total_tool_calls_search"] == 3
    assert m["cost/cpu_s"] == 1.5 and m["cost/total_cpu_s"] == 6.0
    assert "cost/gpu_s" not in m  # a CPU run logs no GPU-seconds
    assert cost_metrics(Spend(gpu_s=2.0), Spend(gpu_s=5.0))["cost/total_gpu_s"] == 5.0


def test_spend_state_round_trips_and_refuses_bad_state():
    s = Spend(10, 20, {"python": 3}, 1.25, 2.5, 0.0)
    assert Spend.from_state_dict(s.state_dict()) == s
    with pytest.raises(ValueError, match="unknown fields"):
        Spend.from_state_dict({**s.state_dict(), "tokens": 1})
    with pytest.raises(ValueError, match="negative or non-finite"):
        Spend.from_state_dict({**s.state_dict(), "rollout_cpu_s": -1.0})
