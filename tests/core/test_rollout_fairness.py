"""A fair schedule (issue 26): keeping AEPO's probe, the budget rule and the penalty change only what they say.

The engine is scripted and random per segment seed: each segment draws its entropy in [0.5, 4) and, for the first
three turns, calls the search tool with probability 0.75.  Its text carries the seed, so two paths have the same
transcript only when they sampled the same segments.  Aggregates over 200 questions × 2 seeds at k = 8.

Before the fix the probe ran alone, was kept as a global, and had all its tool steps decided when it ended, with
the whole branch budget open and ahead of the other globals: at λ = 0 and the same m, aepo's l ≥ 1 share of
branches was 0.315 against arpo's 0.223, and the probe's path took 1.19 branches per question against 0.95 for
arpo's first global (the issue's review).
"""

from __future__ import annotations

import pytest
from scripted_engine import EchoSearch, ScriptedEngine, Segment, random_script

from aepo_core.config import RolloutConfig
from aepo_core.interfaces import GenerationResult
from aepo_core.rollout.scheduler import Question, RolloutResult, RolloutScheduler
from aepo_core.rollout.study import branch_points_by_leaf
from aepo_core.rollout.tree import RolloutTree

QUESTIONS, SEEDS = 200, (0, 1)
BASE = dict(k=8, initial_rollouts=4, beam_size=2, gamma=0.2, tau=0.5, entropy_window=20, max_tool_calls=3,
            max_response_tokens=4000)


def rollouts(cfg: RolloutConfig) -> list[RolloutResult]:
    questions = [Question(f"q{i}", [ord(c) for c in f"Q{i}: what is x?\n"]) for i in range(QUESTIONS)]
    return [RolloutScheduler(ScriptedEngine(random_script), {"search": EchoSearch()}, cfg).run(questions, seed=s)
            for s in SEEDS]


def trees(results: list[RolloutResult]) -> list[RolloutTree]:
    return [t for r in results for t in r.trees]


def consecutive_share(ts: list[RolloutTree]) -> float:
    """Share of the branches created with l ≥ 1 (a branch just before them on their path)."""
    ls = [n.consecutive_branches for t in ts for n in t.nodes if n.branched]
    return sum(1 for c in ls if c > 0) / len(ls)


def first_global_branches(ts: list[RolloutTree]) -> float:
    """Branch points on the path of each question's first global sample (leaf 0), mean over questions."""
    return sum(len(branch_points_by_leaf(t)[0]) for t in ts) / len(ts)


@pytest.fixture(scope="module")
def arpo() -> list[RolloutTree]:
    return trees(rollouts(RolloutConfig(mode="arpo", **BASE)))


@pytest.mark.parametrize("probe", ["reuse", "discard"])
def test_the_probe_gets_no_preferential_share_of_branches(probe, arpo):
    """λ = 0 and β = 0 (m = round(8·σ(0)) = 4 = arpo's m): pre-monitoring may change nothing but m, so aepo's
    consecutive-branch share and the branches on its first global's path (the probe's, when it is reused) equal
    arpo's, within 0.03 and 0.05."""
    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.0, branch_penalty=0.0, probe=probe, **BASE)
    aepo = trees(rollouts(cfg))
    assert {t.global_budget for t in aepo} == {4}
    assert consecutive_share(aepo) == pytest.approx(consecutive_share(arpo), abs=0.03)
    assert first_global_branches(aepo) <= first_global_branches(arpo) + 0.05


def test_a_kept_probe_gets_no_more_branches_than_a_fresh_first_global_at_any_beta():
    """β > 0 (issue 49 §2): m is a function of the probe's own H_root − H̄_tool, and the same entropies give its ΔH
    at each tool step, so a kept probe whose post-tool entropy is high both lowers m (more branch budget) and
    branches more.  Before the fix, at λ = 0 (3 seeds × 300 questions, k = 8) the kept probe's path took 0.759,
    0.730 and 0.692 branches per question at β = 0.5, 1, 2 against 0.687, 0.651 and 0.583 for the first global under
    ``discard`` (a fresh sample).  A kept probe's entropies now set m and do not drive its own decisions: its
    path never branches when β ≠ 0 (and branches like any global at β = 0, where m does not depend on it)."""
    questions = [Question(f"q{i}", [ord(c) for c in f"Q{i}: what is x?\n"]) for i in range(300)]
    excess = []
    for beta in (0.5, 1.0, 2.0):
        first = {}
        for probe in ("reuse", "discard"):
            cfg = RolloutConfig(mode="aepo", premonitor=True, beta=beta, branch_penalty=0.0, probe=probe, **BASE)
            scheduler = RolloutScheduler(ScriptedEngine(random_script), {"search": EchoSearch()}, cfg)
            ts = [t for s in (0, 1, 2) for t in scheduler.run(questions, s).trees]
            first[probe] = first_global_branches(ts)
        assert first["discard"] > 0.3  # a fresh first global does branch: the comparison can see a difference
        excess.append(first["reuse"] - first["discard"])
    assert max(excess) <= 0.0, excess


def decisions(ts: list[RolloutTree]) -> dict[tuple[str, str], tuple[float, int, str]]:
    """Every branch decision by (question, transcript up to and including its segment): (score, l, reason)."""
    out = {}
    for t in ts:
        text = {0: ""}
        for n in t.nodes[1:]:
            text[n.node_id] = text[n.parent_id] + n.text
            if n.branch_reason in ("branch", "below_tau", "penalized", "budget_full"):
                out[(t.question_id, text[n.node_id])] = (n.branch_score, n.consecutive_branches, n.branch_reason)
    return out


def test_decisions_are_paired_across_arms_that_differ_only_in_lambda(arpo):
    """The uniform draw of a decision depends on (seed, question, path, tool step) alone: at every decision both
    arms reach (the same transcript), the score before the penalty is the same, so where the penalty does not bind
    (l = 0) the decision is the same.  Before the fix, one decision that went the other way shifted every later
    draw of its question."""
    lam = 0.5
    paired = decisions(trees(rollouts(RolloutConfig(mode="aepo", premonitor=False, branch_penalty=lam, **BASE))))
    base = decisions(arpo)  # transcripts carry the segment seeds, so the two seeds' decisions never share a key
    both = [key for key in paired if key in base]
    assert len(both) > 500
    mismatched = []
    for key in both:
        (s_a, l_a, r_a), (s_b, _, r_b) = paired[key], base[key]
        factor = max(0.0, 1.0 - lam * l_a)
        if factor > 0 and abs(s_a / factor - s_b) > 1e-9:
            mismatched.append(key)
        if l_a == 0 and "budget_full" not in (r_a, r_b) and (r_a == "branch") != (r_b == "branch"):
            mismatched.append(key)
    assert mismatched == []


@pytest.mark.parametrize("probe", ["reuse", "discard"])
def test_pre_monitoring_at_arpos_m_and_lambda_samples_arpos_trees(probe):
    """With m and λ equal, pre-monitoring changes nothing but what the probe costs: every tree is arpo's node for
    node.  A reused probe's tokens are sampled once (the engine does exactly arpo's work); a discarded one's are
    paid on top."""
    q = 20
    questions = [Question(f"q{i}", [ord(c) for c in f"Q{i}: what is x?\n"]) for i in range(q)]

    def run(cfg: RolloutConfig) -> RolloutResult:
        return RolloutScheduler(ScriptedEngine(random_script), {"search": EchoSearch()}, cfg).run(questions, seed=3)

    base = run(RolloutConfig(mode="arpo", **BASE))
    aepo = run(RolloutConfig(mode="aepo", premonitor=True, beta=0.0, branch_penalty=0.0, probe=probe, **BASE))
    for a, b in zip(aepo.trees, base.trees, strict=True):
        assert [(n.parent_id, n.text, n.branch_reason) for n in a.nodes] == \
               [(n.parent_id, n.text, n.branch_reason) for n in b.nodes]
        assert [(leaf.node_ids, leaf.sample_kind) for leaf in a.leaves] == \
               [(leaf.node_ids, leaf.sample_kind) for leaf in b.leaves]
    extra = aepo.stats["tokens_generated"] - base.stats["tokens_generated"]
    assert extra == 0 if probe == "reuse" else extra > 0


def test_official_budget_rule_reads_a_separate_root_sample():
    """budget_rule official (issue 49 §3): H_root is the entropy of the first W tokens of a separate sample of at
    most root_sample_tokens tokens from the prompt that stops at the tool tags (as the published code samples it),
    H̄_tool averages the probe's first segment with its post-tool ones, and m = min(k, int(k·σ(β(H_root −
    H̄_tool))) + 1)."""
    from scripted_engine import tool_then_answer

    from aepo_core.protocol import STOP_STRINGS

    requests = []

    class Recording(ScriptedEngine):
        def generate(self, reqs, sampling):
            requests.extend(reqs)
            return super().generate(reqs, sampling)

    # Every segment has entropy 2 except the ones after tool results (4, then 0): the root sample is a first
    # segment (2).  H̄_tool = (2 + 4 + 0) / 3 = 2, H_root = 2 → m = int(8·σ(0)) + 1 = 5 (paper rule: 4).
    script = tool_then_answer(2, h_first=2.0, h_after_tool=[4.0, 0.0])
    cfg = RolloutConfig(mode="aepo", premonitor=True, budget_rule="official", **BASE)
    questions = [Question("q0", [ord(c) for c in "Q: what is x?\n"])]
    (tree,) = RolloutScheduler(Recording(script), {"search": EchoSearch()}, cfg).run(questions, seed=0).trees
    root = requests[0]
    assert (root.max_tokens, tuple(root.stop)) == (50, tuple(STOP_STRINGS))
    assert (tree.h_root, tree.h_tool, tree.global_budget) == (2.0, 2.0, 5)
    paper = RolloutScheduler(ScriptedEngine(script), {"search": EchoSearch()},
                             RolloutConfig(mode="aepo", premonitor=True, **BASE)).run(questions, seed=0).trees[0]
    assert (paper.h_tool, paper.global_budget) == (2.0, 4)


def test_the_root_sample_is_scored_on_its_first_w_tokens_only():
    """The published code samples ≤ 50 root tokens and scores the first ≤ 20: tokens past W do not move H_root."""

    class LateSpike(ScriptedEngine):
        def generate(self, reqs, sampling):
            out = super().generate(reqs, sampling)
            return [r if q.max_tokens != 50 else
                    GenerationResult(r.token_ids, r.logprobs, [1.0] * 20 + [9.0] * (len(r.entropies) - 20),
                                     r.finish_reason, r.stop_string)
                    for q, r in zip(reqs, out, strict=True)]

    long_first = lambda transcript, seed: Segment("x" * 60, 1.0)  # noqa: E731  (never stops: 50 root tokens)
    cfg = RolloutConfig(mode="aepo", premonitor=True, budget_rule="official", **{**BASE, "max_response_tokens": 100})
    (tree,) = RolloutScheduler(LateSpike(long_first), {"search": EchoSearch()}, cfg).run(
        [Question("q0", [ord(c) for c in "Q: what is x?\n"])], seed=0).trees
    assert tree.h_root == 1.0


def test_the_official_entropy_scale_sums_the_published_terms_over_w_tokens():
    """entropy_scale official: segments read Σ of the first W published terms (top-10 entropy ÷ ln|V|), the
    published code's scale, in branching (ΔH) and in the budget alike; token entropies stay in nats."""
    import math

    from scripted_engine import SCRIPTED_VOCAB, tool_then_answer

    script = tool_then_answer(1, h_first=1.0, h_after_tool=3.0)
    cfg = RolloutConfig(mode="aepo", premonitor=True, budget_rule="official", entropy_scale="official", **BASE)
    (tree,) = RolloutScheduler(ScriptedEngine(script), {"search": EchoSearch()}, cfg).run(
        [Question("q0", [ord(c) for c in "Q: what is x?\n"])], seed=0).trees
    scale = 20 / math.log(SCRIPTED_VOCAB)  # every segment here is ≥ W = 20 tokens long
    first = next(n for n in tree.nodes if n.kind == "model")
    assert first.segment_entropy == pytest.approx(1.0 * scale) and first.entropies[0] == 1.0
    assert tree.h_root == pytest.approx(1.0 * scale)
    assert tree.h_tool == pytest.approx((1.0 + 3.0) / 2 * scale)
    steps = [n for n in tree.nodes if n.branch_reason in ("branch", "below_tau", "budget_full")]
    assert steps and all(n.delta_entropy == pytest.approx(2.0 * scale) for n in steps)


def test_official_budget_rule_without_a_root_sample_uses_the_probes_first_segment():
    """A root sample the engine fails on does not fail the step: H_root falls back to the probe's first segment."""
    from scripted_engine import tool_then_answer

    class NoRoots(ScriptedEngine):
        def generate(self, reqs, sampling):
            if any(not r.stop for r in reqs):
                raise RuntimeError("root samples unsupported")
            return super().generate(reqs, sampling)

    script = tool_then_answer(1, h_first=3.0, h_after_tool=1.0)
    cfg = RolloutConfig(mode="aepo", premonitor=True, budget_rule="official", **BASE)
    questions = [Question("q0", [ord(c) for c in "Q: what is x?\n"])]
    (tree,) = RolloutScheduler(NoRoots(script), {"search": EchoSearch()}, cfg).run(questions, seed=0).trees
    assert tree.h_root == 3.0 and tree.h_tool == 2.0  # H̄_tool = (3 + 1) / 2: the first segment counts
    assert [leaf.status for leaf in tree.leaves] == ["answered"] * 8  # the step went on
