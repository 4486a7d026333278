"""bench.trl_step: the reward both sides share, the sizes and ``--ours-set`` as overrides of our config, and bad
input refused before any model loads (the step itself is measured by hand: it needs TRL's virtualenv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.trl_side import answer_reward
from bench.trl_step import main, our_config, parse_args, shared_reward


@pytest.mark.parametrize(("text", "score"), [
    ("<think>hm</think><answer>The answer is \\boxed{Paris}.</answer>", 1.0),
    ("<answer> paris! </answer>", 1.0),  # no boxed: the block's text, normalised
    ("<answer>The answer is \\boxed{Lyon}.</answer>", 0.1),
    ("<answer>\\boxed{Lyon}</answer> then <answer>\\boxed{Paris}</answer>", 1.0),  # the last block counts
    ("<answer> </answer>", 0.0),
    ("The answer is Paris", 0.0),
])
def test_answer_reward(text: str, score: float) -> None:
    assert answer_reward(text, ["Paris", "City of Paris"]) == score


def test_our_reward_reads_what_the_model_wrote() -> None:
    transcript = "<search>x</search><result><answer>\\boxed{Paris}</answer></result>"
    res = shared_reward(transcript, ["Paris"], model_text="<search>x</search>")
    assert (res.score, res.reason, res.details) == (0.0, "no_answer", {"em": 0.0})
    assert shared_reward("", ["Paris"], model_text="<answer>\\boxed{Paris}</answer>").details == {"em": 1.0}


def test_sizes_and_overrides_configure_our_side() -> None:
    args = parse_args(["--questions", "2", "--new-tokens", "8", "--ours-set", "model.sampler_dtype=int8"])
    cfg = our_config(args.overrides)
    assert (cfg.data.max_questions, cfg.train.batch_size, cfg.optim.mini_batch_size) == (2, 2, 2)
    assert (cfg.rollout.max_response_tokens, cfg.rollout.k, cfg.rollout.mode) == (8, 4, "independent")
    assert cfg.model.sampler_dtype == "int8" and cfg.algorithm.loss == "ppo_clip"
    assert not cfg.tools.search.enabled and not cfg.tools.python.enabled and cfg.algorithm.kl_coef == 0


def test_bad_input_is_refused_before_anything_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.json"
    assert main(["--ours-set", "model.nope=1", "--out", str(out)]) == 2
    assert "model.nope" in capsys.readouterr().err
    assert main(["--trl-python", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "make trl" in capsys.readouterr().err and not out.exists()
