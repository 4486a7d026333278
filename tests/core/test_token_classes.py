"""Where a policy's entropy lives (aepo_core.token_classes, issue 53 §1): every model token in one class by the
protocol's tags, the root and post-tool windows, the share at or above 0.672 nats — golden values by hand."""

from __future__ import annotations

import math

import pytest

from aepo_core.token_classes import HIGH_ENTROPY_NATS, EntropyTally, char_classes, token_classes

RESPONSE = "<think>Look X.</think><search>X hq</search>\n<result>\nPage 1</result>\n<answer>\\boxed{D}</answer>"


def test_every_character_is_in_its_block() -> None:
    classes = char_classes(RESPONSE)
    by_text = {}
    for ch, cls in zip(RESPONSE, classes, strict=True):
        by_text.setdefault(cls, "")
        by_text[cls] += ch
    assert by_text["thought"] == "Look X."
    assert by_text["query"] == "X hq"
    assert by_text["result"] == "\nPage 1"
    assert by_text["answer"] == "\\boxed{D}"
    assert by_text["template"] == "<think></think><search></search>\n<result></result>\n<answer></answer>"
    # an unclosed block (a truncated response) runs to the end; a stray closing tag is template
    assert char_classes("<think>ab") == ["template"] * 7 + ["thought"] * 2
    assert set(char_classes("</think>x")) == {"template"}


def test_a_token_takes_the_class_of_its_first_non_space_character() -> None:
    pieces = ["<think>", "Look", " X", ".", "</think>", "<search>", "X", " hq", "</search>"]
    text = "".join(pieces)
    assert token_classes(pieces, text) == ["template", "thought", "thought", "thought", "template", "template",
                                           "query", "query", "template"]
    # a piece that straddles a tag boundary: its first non-space character decides
    assert token_classes(["<think>L", "ook</think>"], "<think>Look</think>") == ["template", "thought"]
    # pieces that do not concatenate to the text (a byte-level split of 'é') stay aligned and in range
    assert len(token_classes(["<think>", "\ufffd", "\ufffd", "</think>"], "<think>é</think>")) == 4


def test_the_tally_by_class_and_window() -> None:
    """Two model segments (root: 3 tokens, after a tool result: 2), W = 2: the root window holds the first two model
    tokens, the post-tool window the two after the result; the result's tokens are not the model's."""
    classes = ["template", "thought", "query", "result", "result", "thought", "answer"]
    entropy = [0.0, 1.0, 0.5, 9.0, 9.0, 0.8, 0.1]
    mask = [1, 1, 1, 0, 0, 1, 1]
    tally = EntropyTally()
    tally.add(classes, entropy, mask, window=2)
    m = tally.metrics()
    assert m["entropy_thought"] == pytest.approx(0.9) and m["entropy_query"] == 0.5 and m["entropy_answer"] == 0.1
    assert m["entropy_root_window"] == pytest.approx(0.5) and m["entropy_post_tool_window"] == pytest.approx(0.45)
    assert m["entropy_model"] == pytest.approx(2.4 / 5)
    assert m["high_entropy_share"] == pytest.approx(2 / 5)  # 1.0 and 0.8 are ≥ 0.672
    assert m["share_thought"] == pytest.approx(2 / 5) and m["share_template"] == pytest.approx(1 / 5)
    other = EntropyTally()
    other.add(["thought"], [HIGH_ENTROPY_NATS], [1], window=2)
    tally.merge(other)
    assert tally.metrics()["high_entropy_share"] == pytest.approx(3 / 6)
    assert math.isnan(EntropyTally().metrics()["entropy_model"])


def test_a_run_whose_mechanisms_did_not_act_says_so() -> None:
    """aepo_core.activity on the powered comparison's figures (clipped 0.18 %, post-tool windows 0.07 nats, 0.15
    penalized decisions per question): one sentence per idle mechanism the config turned on, none for those it did
    not, none for a metric the run did not log, none where a mechanism acted."""
    from aepo_core.activity import idle_mechanisms
    from aepo_core.config import ExperimentConfig
    from aepo_core.overrides import build_config

    powered = {"train/clip_frac": 0.0018, "rollout/entropy_post_tool_window": 0.07,
               "rollout/penalized_per_question": 0.15, "rollout/global_budget_std": 0.4,
               "train/high_entropy_share": 0.02, "train/entropy_advantage_factor_max": 3.1}
    notes = idle_mechanisms(powered, build_config(ExperimentConfig().to_dict(), ["rollout.mode=aepo",
                                                                                  "algorithm.loss=aepo"]))
    assert len(notes) == 4, notes
    assert "clipped 0.18% of update tokens" in notes[0] and "2.00% of update tokens" in notes[1]
    assert "0.070 nats" in notes[2] and "0.15 decisions per question" in notes[3]
    grpo = build_config(ExperimentConfig().to_dict(), ["rollout.mode=independent", "algorithm.loss=ppo_clip",
                                                        "algorithm.entropy_advantage=false"])
    assert [n.split(" ")[1] for n in idle_mechanisms(powered, grpo)] == ["ppo_clip", "of"]  # no rollout mechanism
    assert idle_mechanisms({}, grpo) == []
    acting = {**powered, "train/clip_frac": 0.03, "train/high_entropy_share": 0.2,
              "rollout/entropy_post_tool_window": 0.6, "rollout/penalized_per_question": 1.0}
    assert idle_mechanisms(acting, build_config(ExperimentConfig().to_dict(), ["rollout.mode=aepo"])) == []


def test_an_idle_pre_monitoring_names_the_band_of_its_m() -> None:
    """Pre-monitoring that gave every question the same m says for which entropy gaps the rule gives that m: at the
    demo's k = 4 and β = 0.5, m = 2 for any |H_root − H̄_tool| under 1.02 nats (the demo's gaps were ~0.2), which is
    why m never moved there (issue 53, candidate 1)."""
    from aepo_core.activity import idle_mechanisms
    from aepo_core.config import ExperimentConfig
    from aepo_core.overrides import build_config

    demo = build_config(ExperimentConfig().to_dict(),
                        ["rollout.mode=aepo", "rollout.k=4", "rollout.initial_rollouts=2"])
    same_m = {"rollout/global_budget_std": 0.0, "rollout/global_budget_mean": 2.0}
    [note] = idle_mechanisms(same_m, demo)
    assert "m = 2" in note and "−1.02 and +1.02 nats" in note and "k = 4, β = 0.5" in note, note
    [note] = idle_mechanisms({**same_m, "rollout/global_budget_mean": 4.0}, demo)
    assert "at or above +3.89 nats" in note, note  # m = k: the band is open above
    assert idle_mechanisms({**same_m, "rollout/global_budget_std": 0.5}, demo) == []
