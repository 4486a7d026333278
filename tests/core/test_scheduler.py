"""The rollout scheduler with a scripted engine: exact trees per mode, budget, penalty, faults, limits."""

from __future__ import annotations

import random

import pytest
from scripted_engine import EchoSearch, ScriptedEngine, Segment, tool_then_answer

from aepo_core.config import RolloutConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import build_config
from aepo_core.rollout.scheduler import EngineFailure, Question, RolloutScheduler
from aepo_core.rollout.tree import RolloutTree

PROMPT = [ord(c) for c in "Q: what is x?\n"]


def run(script, cfg: RolloutConfig, n_questions: int = 1, seed: int = 0, tools=None, engine=None, **kw):
    engine = engine or ScriptedEngine(script)
    sched = RolloutScheduler(engine, tools or {"search": EchoSearch()}, cfg, **kw)
    qs = [Question(f"q{i}", PROMPT) for i in range(n_questions)]
    return sched.run(qs, seed=seed), engine


def shape(tree: RolloutTree) -> list[tuple[str, str, int]]:
    """(sample kind, status, number of tool calls) per leaf, in leaf order."""
    return [(leaf.sample_kind, leaf.status, len(tree.tool_events(leaf))) for leaf in tree.leaves]


def reasons(tree: RolloutTree) -> list[str]:
    return [n.branch_reason for n in tree.nodes if n.kind == "model"]


# H_root = 1, every post-tool segment 4 → ΔH = 3, u + γΔH ∈ [0.6, 1.6): always ≥ τ at l = 0;
# λ = 0.7 → at l = 1 the score is ≤ 0.48 < τ: the penalty stops the second consecutive branch.
SCRIPT = tool_then_answer(calls=2, h_first=1.0, h_after_tool=4.0)
BASE = dict(k=4, initial_rollouts=2, beam_size=2, gamma=0.2, tau=0.5, branch_penalty=0.7, entropy_window=20,
            max_tool_calls=6, max_response_tokens=2000)


def test_aepo_tree_probe_penalty_and_fill():
    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.5, **BASE)
    res, _engine = run(SCRIPT, cfg)
    (tree,) = res.trees
    # m = round(4·σ(0.5·(1 − 4))) = round(0.73) = 1: the probe is the only planned global sample.
    assert tree.global_budget == 1 and tree.h_root == 1.0 and tree.h_tool == 4.0
    assert shape(tree) == [("global", "answered", 2), ("branch", "answered", 2), ("fill", "answered", 2),
                           ("fill", "answered", 2)]
    probe, fork = tree.leaves[0], tree.leaves[1]
    probe_reasons = [tree.nodes[i].branch_reason for i in probe.node_ids if tree.nodes[i].kind == "model"]
    assert probe_reasons == ["", "branch", "penalized"]
    fork_reasons = [tree.nodes[i].branch_reason for i in fork.node_ids if tree.nodes[i].kind == "model"]
    assert fork_reasons == ["", "fork", "penalized"]  # the fork inherits l = 1 from its ancestor step
    # The fork shares the probe's prefix up to and including the first tool result.
    assert fork.node_ids[:3] == probe.node_ids[:3] and tree.nodes[probe.node_ids[2]].kind == "tool"
    assert probe.branch_steps == 1 and fork.branch_steps == 1
    # Fill samples found the budget full.
    fill_reasons = [tree.nodes[i].branch_reason for i in tree.leaves[2].node_ids if tree.nodes[i].kind == "model"]
    assert fill_reasons == ["", "budget_full", "budget_full"]
    assert res.stats["global_samples"] == 1 and res.stats["branch_samples"] == 1 and res.stats["fill_samples"] == 2
    assert res.branch_rate_by_consecutive == {0: 1.0, 1: 0.0}


def test_arpo_tree_branches_without_penalty_until_budget_exhausted():
    cfg = RolloutConfig(mode="arpo", **BASE)
    res, _ = run(SCRIPT, cfg)
    (tree,) = res.trees
    assert tree.global_budget == 2
    assert shape(tree) == [("global", "answered", 2), ("global", "answered", 2), ("branch", "answered", 2),
                           ("branch", "answered", 2)]
    g0 = [tree.nodes[i].branch_reason for i in tree.leaves[0].node_ids if tree.nodes[i].kind == "model"]
    # λ = 0: the second step would branch again (l = 1 does not matter) but the budget is exhausted.
    assert g0 == ["", "branch", "budget_full"]
    assert len(tree.leaves) == 4


def test_independent_mode_never_branches():
    cfg = RolloutConfig(mode="independent", **BASE)
    res, _ = run(SCRIPT, cfg, n_questions=3)
    for tree in res.trees:
        assert shape(tree) == [("global", "answered", 2)] * 4
        assert set(reasons(tree)) == {""}
    assert res.stats["branch_samples"] == 0


def test_aepo_without_premonitor_uses_initial_rollouts():
    cfg = RolloutConfig(mode="aepo", premonitor=False, **BASE)
    res, _ = run(SCRIPT, cfg)
    assert res.trees[0].global_budget == 2
    assert [leaf.sample_kind for leaf in res.trees[0].leaves] == ["global", "global", "branch", "branch"]


def test_premonitor_more_question_uncertainty_gives_more_global_samples():
    cfg = RolloutConfig(mode="aepo", premonitor=True, **{**BASE, "k": 8})
    res, _ = run(tool_then_answer(2, h_first=6.0, h_after_tool=0.5), cfg)
    tree = res.trees[0]
    # H_root ≫ H̄_tool: m = round(8·σ(0.5·5.5)) = 8; ΔH < 0 as well, so nothing branches.
    assert tree.global_budget == 8
    assert [leaf.sample_kind for leaf in tree.leaves] == ["global"] * 8


def test_no_tool_calls_gives_half_the_budget_and_fill():
    cfg = RolloutConfig(mode="aepo", premonitor=True, **BASE)
    res, _ = run(tool_then_answer(0, h_first=2.0, h_after_tool=2.0), cfg)
    tree = res.trees[0]
    assert tree.h_tool == tree.h_root == 2.0 and tree.global_budget == 2  # σ(0)·4
    assert [leaf.sample_kind for leaf in tree.leaves] == ["global", "global", "fill", "fill"]


def test_loss_mask_is_zero_exactly_on_tool_tokens_and_text_round_trips():
    cfg = RolloutConfig(mode="aepo", premonitor=True, **BASE)
    res, engine = run(SCRIPT, cfg)
    tree = res.trees[0]
    for leaf in tree.leaves:
        ids, mask = tree.response_ids(leaf), tree.loss_mask(leaf)
        assert len(ids) == len(mask) == len(tree.logprobs(leaf)) == len(tree.entropies(leaf))
        text = engine.decode(ids)
        assert text == tree.text(leaf)
        for node in tree.path(leaf)[1:]:
            span = mask[node.token_start : node.token_end]
            assert span == [1 if node.kind == "model" else 0] * len(node.token_ids)
            if node.kind == "tool":
                assert engine.decode(node.token_ids).startswith("\n<result>\nPage 1: doc about q")


def test_same_seed_same_tree_and_different_seed_differs():
    rng_script = lambda transcript, seed: Segment(  # noqa: E731
        "<search>q</search>" if transcript.count("<result>") < 3 else "<answer>\\boxed{1}</answer>",
        random.Random(transcript.count("<result>") * 7 + seed % 1000).uniform(0, 5),
    )
    cfg = RolloutConfig(mode="aepo", premonitor=True, **{**BASE, "k": 6, "branch_penalty": 0.05})

    def signature(seed):
        res, _ = run(rng_script, cfg, n_questions=3, seed=seed)
        return [[(n.parent_id, n.kind, n.branch_reason, tuple(n.token_ids)) for n in t.nodes] for t in res.trees]

    assert signature(5) == signature(5)
    assert any(signature(s) != signature(5) for s in (6, 7, 8))


@pytest.mark.parametrize("mode", ["aepo", "arpo", "independent"])
def test_no_question_ever_exceeds_k_leaves(mode):
    for seed in range(15):
        rng = random.Random(seed)
        k = rng.randint(1, 7)
        cfg = RolloutConfig(mode=mode, premonitor=rng.random() < 0.7, **{
            **BASE, "k": k, "initial_rollouts": rng.randint(1, k), "beam_size": rng.randint(2, 4),
            "branch_penalty": rng.choice([0.0, 0.05, 0.5])})
        script = tool_then_answer(rng.randint(0, 4), rng.uniform(0, 3), [rng.uniform(0, 6) for _ in range(4)])
        res, _ = run(script, cfg, n_questions=2, seed=seed)
        for tree in res.trees:
            assert len(tree.leaves) == k
            assert all(leaf.status == "answered" for leaf in tree.leaves)
            assert sum(1 for leaf in tree.leaves if leaf.sample_kind == "global") <= tree.global_budget


def test_an_engine_error_on_any_row_fails_the_rollout_and_returns_no_tree():
    """Issue 50: a fault is never data. Before, the failed rows became leaves with status engine_error beside the
    other question's answered ones, and were scored (as wrong) and trained on. Now the rollout raises, counting the
    failed requests among all it sent and quoting the first error."""
    engine = ScriptedEngine(SCRIPT, fail_when=lambda t: t.count("<result>") == 1 and "q0" in t and "step 1" not in t)
    cfg = RolloutConfig(mode="independent", **BASE)
    with pytest.raises(EngineFailure, match=r"the engine failed 8 of 16 requests \(after its own retries\); the "
                                            r"first: scripted failure\. Nothing of this rollout was scored"):
        run(SCRIPT, cfg, n_questions=2, engine=engine)  # every path's second segment fails: 8 of 8 + 8
    failed: list[str] = []

    def first_second_segment(transcript: str) -> bool:  # fails one request: the first second segment asked for
        hit = transcript.count("<result>") == 1 and not failed
        failed.extend([transcript] if hit else [])
        return hit

    one = ScriptedEngine(SCRIPT, fail_when=first_second_segment)
    with pytest.raises(EngineFailure, match=r"failed 1 of \d+ requests") as caught:  # one failed row is enough
        run(SCRIPT, cfg, n_questions=2, engine=one)
    assert str(caught.value.on("rollout.engine=vllm")).startswith("rollout.engine=vllm failed 1 of ")
    engine_ok = ScriptedEngine(SCRIPT, fail_when=lambda t: False)
    res_ok, _ = run(SCRIPT, cfg, n_questions=2, engine=engine_ok)
    assert all(leaf.status == "answered" for t in res_ok.trees for leaf in t.leaves)


def test_batch_exception_falls_back_to_rows():
    class Flaky(ScriptedEngine):
        def generate(self, requests, sampling):
            if len(requests) > 1:
                raise RuntimeError("batch too large")
            return super().generate(requests, sampling)

    cfg = RolloutConfig(mode="independent", **BASE)
    res, _ = run(SCRIPT, cfg, engine=Flaky(SCRIPT))
    assert all(leaf.status == "answered" for leaf in res.trees[0].leaves)


def test_tool_faults_become_results():
    tools = {"search": EchoSearch(fail={"q0"}, raise_on={"q1"})}
    cfg = RolloutConfig(mode="independent", **BASE)
    res, _ = run(SCRIPT, cfg, tools=tools)
    tree = res.trees[0]
    for leaf in tree.leaves:
        events = tree.tool_events(leaf)
        assert [(e.ok, e.error) for e in events] == [(False, "unavailable"), (False, "exception")]
        assert leaf.status == "answered"
        assert "backend exploded" in tree.text(leaf)
    assert res.stats["tool_error_rate"] == 1.0


def test_hanging_tool_times_out():
    tools = {"search": EchoSearch(hang_on={"q1"}, hang_s=3.0)}
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 2})
    res, _ = run(SCRIPT, cfg, tools=tools, tool_timeout_s=0.3)
    tree = res.trees[0]
    events = tree.tool_events(tree.leaves[0])
    assert events[1].error == "timeout" and not events[1].ok
    assert "timed out" in tree.text(tree.leaves[0])
    assert res.stats["tools_s"] < 2.5


def test_tool_limit_and_unknown_tool():
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1, "max_tool_calls": 1})
    endless = lambda t, s: Segment("<search>again</search>", 1.0)  # noqa: E731
    res, _ = run(endless, cfg)
    leaf = res.trees[0].leaves[0]
    assert leaf.status == "tool_limit"
    names = [e.name for e in res.trees[0].tool_events(leaf)]
    assert names == ["search", "limit"]
    assert "Tool call limit reached" in res.trees[0].text(leaf)

    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1})
    res, _ = run(tool_then_answer(1, 1.0, 1.0, tool="python"), cfg)
    leaf = res.trees[0].leaves[0]
    assert "not available" in res.trees[0].text(leaf) and leaf.status == "answered"


def test_response_budget_truncates_including_tool_tokens():
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1, "max_response_tokens": 60})
    res, _ = run(SCRIPT, cfg)
    tree = res.trees[0]
    leaf = tree.leaves[0]
    assert leaf.status == "truncated"
    assert len(tree.response_ids(leaf)) <= 60


def test_segment_cap_continues_the_turn():
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1, "max_segment_tokens": 8, "entropy_window": 8})
    target = "<answer>\\boxed{42}</answer>"
    prompt = "".join(map(chr, PROMPT))
    script = lambda t, s: Segment(target[len(t) - len(prompt) :], 1.0)  # noqa: E731
    res, _engine = run(script, cfg)
    tree = res.trees[0]
    leaf = tree.leaves[0]
    assert leaf.status == "answered"
    assert all(len(n.token_ids) <= 8 for n in tree.path(leaf)[1:])
    assert len(tree.path(leaf)) > 2
    assert tree.text(leaf) == target


def test_batching_across_questions_and_paths():
    cfg = RolloutConfig(mode="independent", **BASE)
    _, engine = run(SCRIPT, cfg, n_questions=3)
    assert max(engine.calls) == 12  # all 3 × 4 paths generated in one batch per round


def test_tool_call_split_by_the_segment_cap_is_still_parsed():
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1, "max_segment_tokens": 7, "entropy_window": 7})
    prompt = "".join(map(chr, PROMPT))

    def script(t, s):
        turn_start = t.rfind("</result>\n") + len("</result>\n") if "<result>" in t else len(prompt)
        done = t[turn_start:]
        full = "<search>kavo</search>" if "<result>" not in t else "<answer>\\boxed{1}</answer>"
        return Segment(full[len(done) :], 1.0)

    res, _ = run(script, cfg)
    tree = res.trees[0]
    leaf = tree.leaves[0]
    assert leaf.status == "answered"
    assert [e.argument for e in tree.tool_events(leaf)] == ["kavo"]


def test_zero_token_segments_cannot_loop_forever():
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1})
    res, _ = run(lambda t, s: Segment("", 1.0), cfg)
    assert res.trees[0].leaves[0].status == "truncated"


def test_questions_advance_without_waiting_for_each_other():
    """No global barrier: a quick question runs its budget while a slow probe still searches, and each tree is
    exactly the tree the question gets alone."""
    quick, slow = tool_then_answer(0, 1.0, 1.0), tool_then_answer(4, 1.0, 4.0)

    def script(transcript: str, seed: int) -> Segment:
        return (slow if transcript.startswith("Q: slow") else quick)(transcript, seed)

    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.5, **{**BASE, "max_tool_calls": 8})
    prompts = {name: [ord(c) for c in f"Q: {name} one?\n"] for name in ("quick", "slow")}

    def rollout(names: list[str]) -> tuple[list[RolloutTree], ScriptedEngine]:
        engine = ScriptedEngine(script)
        sched = RolloutScheduler(engine, {"search": EchoSearch()}, cfg)
        res = sched.run([Question(n, prompts[n]) for n in names], seed=3)
        return res.trees, engine

    (slow_alone,), slow_engine = rollout(["slow"])
    (quick_alone,), quick_engine = rollout(["quick"])
    (slow_tree, quick_tree), both = rollout(["slow", "quick"])

    def signature(tree: RolloutTree) -> list[tuple[object, ...]]:
        return [(n.node_id, n.parent_id, n.kind, n.branch_reason, tuple(n.token_ids)) for n in tree.nodes]

    assert signature(slow_tree) == signature(slow_alone) and signature(quick_tree) == signature(quick_alone)
    # The quick question's probe, globals and fill all ride along the slow probe's rounds.
    assert len(quick_engine.calls) <= 3 < len(slow_engine.calls)
    assert len(both.calls) == len(slow_engine.calls)
    assert both.calls[: len(quick_engine.calls)] == [a + b for a, b in zip(slow_engine.calls, quick_engine.calls)]


# ---------------------------------------------------------------- issue 11, second pass


def test_forks_from_the_probe_do_not_eat_the_global_samples():
    """m global samples start even when the probe's own tool steps forked branches (AEPO.md §3: the probe is the
    first of the m globals; its forks come out of the k − m branch budget)."""
    # H_root = 2, post-tool entropies 4 then 0: H̄_tool = 2 → m = round(8·σ(0)) = 4.  γ = 1: the first step
    # (ΔH = +2) always branches, the second (ΔH = −2) never does.
    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.5, **{**BASE, "k": 8, "gamma": 1.0})
    res, _ = run(tool_then_answer(2, h_first=2.0, h_after_tool=[4.0, 0.0]), cfg)
    (tree,) = res.trees
    assert tree.global_budget == 4
    probe = tree.leaves[0]
    assert [tree.nodes[i].branch_reason for i in probe.node_ids if tree.nodes[i].kind == "model"][1] == "branch"
    kinds = [leaf.sample_kind for leaf in tree.leaves]
    assert kinds.count("global") == 4 and len(kinds) == 8


@pytest.mark.parametrize("tail", ["!!", "!! more text past the stop"])
def test_stop_string_split_by_the_segment_cap_cuts_the_model_node_at_the_stop(tail):
    """`</se|arch>`: the cap cuts the stop string; the engine sees only the new segment and runs on (to EOS, or
    to the cap).  The call is still executed, the model node ends exactly at the stop string, and no token past
    it is kept (none carries loss mask 1)."""
    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1, "max_segment_tokens": 16, "entropy_window": 16})
    prompt = "".join(map(chr, PROMPT))

    def script(t, s):
        turn_start = t.rfind("</result>\n") + len("</result>\n") if "<result>" in t else len(prompt)
        full = "<search>kavo</search>" + tail if "<result>" not in t else "<answer>\\boxed{1}</answer>"
        return Segment(full[len(t) - turn_start :], 1.0, eos="<result>" not in t)

    res, engine = run(script, cfg)
    tree = res.trees[0]
    leaf = tree.leaves[0]
    assert [e.argument for e in tree.tool_events(leaf)] == ["kavo"]
    assert leaf.status == "answered"
    path = tree.path(leaf)
    first_tool = next(i for i, n in enumerate(path) if n.kind == "tool")
    assert "".join(n.text for n in path[1:first_tool]) == "<search>kavo</search>"
    assert path[first_tool - 1].finish_reason == "stop"
    ids, mask = tree.response_ids(leaf), tree.loss_mask(leaf)
    trained = engine.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "<search>kavo</search><answer>\\boxed{1}</answer>"
    assert tree.text(leaf).startswith("<search>kavo</search>\n<result>\nPage 1: doc about kavo\n</result>\n")


def test_tool_timeout_counts_from_the_start_of_each_call_not_the_queue():
    """32 calls of 0.2 s on 4 workers take 1.6 s in all, but none runs for 1 s: none times out.  A call that
    really runs longer than the timeout still does."""
    prompt = "".join(map(chr, PROMPT))

    def script(t, s):
        qid = t.split("\n", 1)[0]
        return Segment(f"<search>{qid}</search>" if "<result>" not in t else "<answer>\\boxed{1}</answer>", 1.0)

    cfg = RolloutConfig(mode="independent", **{**BASE, "k": 1})
    # The hang (10 s) is far from the bound below (6 s), and the bound far from the ~2.6 s a working timeout takes:
    # a loaded 2-core machine has seconds of margin on both sides (the pool is not waited for at the end).
    tools = {"search": EchoSearch(hang_on={"Q32"}, hang_s=10.0, delay_s=0.2)}
    sched = RolloutScheduler(ScriptedEngine(script), tools, cfg, tool_timeout_s=1.0, tool_workers=4)
    res = sched.run([Question(f"q{i}", [ord(c) for c in f"Q{i}\n{prompt}"]) for i in range(33)], seed=0)
    events = {tree.question_id: tree.tool_events(tree.leaves[0])[0] for tree in res.trees}
    assert events.pop("q32").error == "timeout"
    assert [(e.ok, e.error) for e in events.values()] == [(True, None)] * 32
    assert res.stats["tools_s"] < 6.0


def steps(*segments: tuple[str, float]):
    """A script that writes segments[n] after the n-th result (the last one from then on)."""
    return lambda t, s: Segment(*segments[min(t.count("<result>"), len(segments) - 1)])


def assert_forks_are_copies(tree: RolloutTree) -> None:
    """The script depends on the transcript only, so a fork that is an exact copy of its path's state
    continues exactly as the path did: every leaf has the same text, status and tool events."""
    assert any(leaf.sample_kind == "branch" for leaf in tree.leaves)
    texts = {tree.text(leaf) for leaf in tree.leaves}
    outcomes = {(leaf.status, tuple((e.name, e.ok) for e in tree.tool_events(leaf))) for leaf in tree.leaves}
    assert len(texts) == 1 and len(outcomes) == 1, (texts, outcomes)


def test_a_fork_counts_only_real_tool_calls():
    """A notice (here: an unknown tool) before the fork point is no tool call, for the fork as for the path."""
    script = steps(("<search>q0</search>", 1.0), ("<python>x</python>", -20.0), ("<search>q1</search>", -20.0),
                   ("<search>q2</search>", 4.0), ("<answer>\\boxed{1}</answer>", 1.0))
    cfg = RolloutConfig(mode="arpo", **{**BASE, "k": 2, "initial_rollouts": 1, "max_tool_calls": 3})
    res, _ = run(script, cfg)
    (tree,) = res.trees
    assert [e.name for e in tree.tool_events(tree.leaves[0])] == ["search", "invalid", "search", "search"]
    assert_forks_are_copies(tree)


@pytest.mark.parametrize("mode", ["arpo", "aepo"])
def test_a_fork_inherits_that_the_last_tool_call_failed(mode):
    """A fork made right after a failed call that then runs out of budget ends ``tool_error``, like its path
    (aepo: the probe's fork, made after the probe finished, still copies the state at the fork point)."""
    script = steps(("<search>bad</search>", 1.0), ("<think>" + "x" * 300, 4.0))
    cfg = RolloutConfig(mode=mode, **{**BASE, "k": 2, "initial_rollouts": 1, "max_response_tokens": 120})
    res, _ = run(script, cfg, tools={"search": EchoSearch(fail={"bad"})})
    (tree,) = res.trees
    assert tree.leaves[0].status == "tool_error"
    assert_forks_are_copies(tree)


def test_no_branch_decision_after_a_notice():
    """Branch decisions follow real tool results only: not the 'invalid' or 'limit' notices."""
    script = steps(("<search>q0</search>", 1.0), ("<python>x</python>", 4.0), ("<search>q1</search>", 4.0),
                   ("<search>q2</search>", 4.0), ("<search>q3</search>", 4.0))
    cfg = RolloutConfig(mode="arpo", **{**BASE, "k": 8, "initial_rollouts": 1, "max_tool_calls": 2})
    res, _ = run(script, cfg)
    (tree,) = res.trees
    names = [e.name for e in tree.tool_events(tree.leaves[0])]
    assert names == ["search", "invalid", "search", "limit"] and tree.leaves[0].status == "tool_limit"
    after_notice = [n for n in tree.nodes if n.kind == "model" and tree.nodes[n.parent_id].kind == "tool"
                    and tree.nodes[n.parent_id].tool.name in ("invalid", "limit")]
    assert after_notice and all(n.branch_reason in ("", "fork") and n.branch_score != n.branch_score
                                for n in after_notice)
    forked_from = {tree.nodes[n.parent_id].tool.name for n in tree.nodes if n.branch_reason == "fork"}
    assert forked_from == {"search"}
    assert_forks_are_copies(tree)


def test_segment_cap_below_the_entropy_window_is_a_config_error():
    """A segment capped below W would average fewer than W tokens (the window would silently shrink)."""
    with pytest.raises(ConfigError, match=r"rollout\.max_segment_tokens.*rollout\.entropy_window"):
        build_config({}, ["rollout.max_segment_tokens=16"])
    with pytest.raises(ConfigError, match=r"rollout\.max_segment_tokens.*rollout\.entropy_window"):
        build_config({"rollout": {"max_segment_tokens": 8, "entropy_window": 9}})
    assert build_config({}, ["rollout.max_segment_tokens=16", "rollout.entropy_window=16"]).rollout.entropy_window == 16
    assert build_config({}, ["rollout.max_segment_tokens=20"]).rollout.max_segment_tokens == 20


@pytest.mark.parametrize("mode", ["aepo", "arpo", "independent"])
def test_a_question_s_tree_does_not_depend_on_the_rest_of_its_batch(mode):
    """Randomness is keyed by the question's id, not its position in the batch (issue 49 §4): the same question
    gets the same tree alone, second in a batch, after others are removed, or with the batch reordered; so arms
    that see different batches still pair question by question."""
    rng_script = lambda transcript, seed: Segment(  # noqa: E731
        "<search>q</search>" if transcript.count("<result>") < 2 else "<answer>\\boxed{1}</answer>",
        random.Random(seed).uniform(0, 5),
    )
    cfg = RolloutConfig(mode=mode, premonitor=True, **{**BASE, "k": 6, "branch_penalty": 0.05})
    prompts = {qid: [ord(c) for c in f"Q{qid}: what is x?\n"] for qid in ("a", "b", "c", "d")}

    def trees(order: list[str]) -> dict[str, list[tuple]]:
        sched = RolloutScheduler(ScriptedEngine(rng_script), {"search": EchoSearch()}, cfg)
        res = sched.run([Question(q, prompts[q]) for q in order], seed=11)
        return {t.question_id: [(n.parent_id, n.kind, n.branch_reason, tuple(n.token_ids), n.segment_entropy)
                                for n in t.nodes] for t in res.trees}

    full = trees(["a", "b", "c", "d"])
    assert trees(["b"])["b"] == full["b"]
    assert trees(["d", "c", "b", "a"]) == full
    assert trees(["a", "c", "d"])["c"] == full["c"]
    assert len({str(t) for t in full.values()}) == 4  # the questions themselves differ (the test can see a mix-up)


def test_a_question_repeated_in_a_batch_gets_its_own_draws():
    """Two rows of one question id in a batch (a question sampled twice) are distinct samples, not copies."""
    rng_script = lambda transcript, seed: Segment(  # noqa: E731
        "<search>q</search>" if transcript.count("<result>") < 2 else "<answer>\\boxed{1}</answer>",
        random.Random(seed).uniform(0, 5),
    )
    cfg = RolloutConfig(mode="aepo", premonitor=True, **{**BASE, "k": 6})
    sched = RolloutScheduler(ScriptedEngine(rng_script), {"search": EchoSearch()}, cfg)
    first, second = sched.run([Question("a", PROMPT), Question("a", PROMPT)], seed=3).trees
    assert [n.segment_entropy for n in first.nodes] != [n.segment_entropy for n in second.nodes]
