"""Rewards: boxed extraction, SQuAD normalization, EM/F1, the deep-search reward, math equivalence."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aepo_core.config import RewardConfig
from aepo_core.interfaces import RewardFn, RewardResult
from aepo_core.protocol import result_block
from aepo_core.rewards import (
    REWARD_FNS,
    deepsearch_reward,
    em_reward,
    exact_match,
    extract_boxed,
    f1_reward,
    make_reward_fn,
    math_reward,
    normalize_answer,
    predicted_answer,
    token_f1,
)

ROOT = Path(__file__).resolve().parents[2]


def transcript(answer: str, tools: tuple[str, ...] = ("search", "python")) -> str:
    """A well-formed response that calls ``tools`` in order and answers ``answer``."""
    parts = ["<think>plan</think>"]
    for name in tools:
        parts.append(f"<{name}>arg</{name}>\n<result>\nout\n</result>\n<think>next</think>")
    parts.append(f"<answer>{answer}</answer>")
    return "".join(parts)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed 5$ done", "5"),
        ("\\boxed 5", "5"),
        ("\\boxed {7}", "7"),
        ("\\fbox{Paris}", "Paris"),
        ("\\boxed{1} and \\fbox{3}", "3"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{ spaced }", "spaced"),
        ("\\boxed{}", ""),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("\\boxed{1} then \\boxed{2", None),  # the last one is malformed: no fallback
        ("no box", None),
        ("\\boxedfoo{1}", None),
        ("\\boxed", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("Yes.", "yes"),
        ("  An   apple ", "apple"),
        ("\"Paris\"", "paris"),
        ("“Zürich”", "zürich"),
        ("'Zürich'", "zürich"),
        ("Zu\u0308rich", "zürich"),  # decomposed umlaut composes under NFKC
        ("ＡＢＣ　１２３", "abc 123"),  # full-width letters, digits and space
        ("\\text{New York}", "new york"),
        ("\\textbf{\\text{Bern}}", "bern"),
        ("5\\text{ km}", "5 km"),
        ("Straße", "strasse"),
        ("«Le Monde»", "le monde"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_exact_match() -> None:
    assert exact_match("Yes.", "yes") == 1.0
    assert exact_match("no", ["yes", "No"]) == 1.0
    assert exact_match("Zurich", "Zürich") == 0.0
    assert exact_match("ＺＵＲＩＣＨ", ["\"zurich\""]) == 1.0  # stray quotes in the gold do not matter
    assert exact_match("the", "a") == 0.0  # empty after normalization never matches
    assert exact_match(None, "x") == 0.0
    assert exact_match("x", []) == 0.0


def test_token_f1() -> None:
    assert token_f1("Barack Obama", "Obama") == pytest.approx(2 / 3)
    assert token_f1("the president Barack Obama", ["Michelle Obama", "Barack Obama"]) == pytest.approx(0.8)
    assert token_f1("Paris", "'Paris'") == 1.0
    assert token_f1("London", ["Paris", "Rome"]) == 0.0
    assert token_f1("x y y", "y y z") == pytest.approx(2 / 3)
    assert token_f1("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article and is dropped
    assert token_f1("", "x") == 0.0
    assert token_f1(None, "x") == 0.0
    # a bare string is one gold, not a sequence of one-character golds
    assert token_f1("p", "Paris") == 0.0


def test_predicted_answer() -> None:
    assert predicted_answer("<answer>It is \\boxed{\\frac{a}{b}}</answer>") == "\\frac{a}{b}"
    assert predicted_answer("<answer> Bern </answer>") == "Bern"
    assert predicted_answer("no block but \\boxed{7}") == "7"
    assert predicted_answer("nothing") is None


def test_deepsearch_reward_correct_with_both_tools() -> None:
    res = deepsearch_reward(transcript("\\boxed{Bern}"), ["Berne", "Bern"], ("search", "python"))
    assert res == RewardResult(1.1, "correct", {"f1": 1.0, "em": 1.0, "format_ok": 1.0, "tool_bonus": 0.1})


def test_deepsearch_reward_partial_without_python() -> None:
    res = deepsearch_reward(transcript("\\boxed{Barack Obama}", ("search",)), "Obama", ("search",))
    assert res.score == pytest.approx(2 / 3)
    assert res.reason == "partial"
    assert res.details["tool_bonus"] == 0.0


def test_deepsearch_reward_reads_tools_from_transcript_when_not_given() -> None:
    res = deepsearch_reward(transcript("\\boxed{yes}"), "Yes.")
    assert res.score == pytest.approx(1.1)
    res_none = deepsearch_reward(transcript("\\boxed{yes}", ()), "Yes.")
    assert res_none.score == 1.0


def test_deepsearch_reward_no_bonus_when_wrong() -> None:
    res = deepsearch_reward(transcript("\\boxed{London}"), "Paris", ("search", "python"))
    assert res.score == 0.0
    assert res.reason == "wrong"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<think>x</think>", "no_answer"),
        ("<search>q</search><answer>\\boxed{Bern}</answer>", "tool_call_without_result"),
        ("<answer>Bern</answer>", "no_boxed"),
        ("<think>x<answer>\\boxed{Bern}</answer>", "unbalanced_think"),
    ],
)
def test_deepsearch_reward_format_penalty(text: str, reason: str) -> None:
    res = deepsearch_reward(text, "Bern", ("search",), format_penalty=-0.5)
    assert res.score == -0.5
    assert res.reason == reason
    assert res.details["format_ok"] == 0.0


def test_em_and_f1_rewards() -> None:
    boxed_text = em_reward("<answer>\\boxed{\\text{Yes}}</answer>", "yes")
    assert boxed_text == RewardResult(1.0, "correct", {"em": 1.0})
    assert em_reward("<answer>Yes.</answer>", ["no", "yes"]).score == 1.0  # falls back to the block text
    assert em_reward("nothing", "yes") == RewardResult(0.0, "no_answer", {"em": 0.0})
    res = f1_reward("<answer>\\boxed{New York City}</answer>", "new york")
    assert res.score == pytest.approx(0.8)
    assert res.reason == "partial"
    assert f1_reward("", "x").reason == "no_answer"


@pytest.mark.parametrize(
    ("answer", "golds", "expected"),
    [
        ("\\boxed{0.5}", "\\frac{1}{2}", RewardResult(1.0, "equivalent")),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", RewardResult(1.0, "equivalent")),
        ("\\boxed{\\frac{a}{b}}", ["7", "a/b"], RewardResult(1.0, "equivalent")),
        ("\\boxed{3}", ["4", "5"], RewardResult(0.0, "not_equivalent")),
        ("no boxed number", "3", RewardResult(0.0, "not_equivalent")),  # block text is parsed as a fallback
        ("", "3", RewardResult(0.0, "no_answer")),
        ("\\boxed{}", "3", RewardResult(0.0, "no_answer")),
    ],
)
def test_math_reward(answer: str, golds: str | list[str], expected: RewardResult) -> None:
    assert math_reward(f"<answer>{answer}</answer>", golds) == expected


def test_math_reward_no_answer_block() -> None:
    assert math_reward("I think it is 3", "3") == RewardResult(0.0, "no_answer")


def test_math_reward_parse_error_when_nothing_extracts() -> None:
    assert math_reward("<answer>\\boxed{3}</answer>", "$$") == RewardResult(0.0, "parse_error")
    assert math_reward("<answer>\\boxed{$$}</answer>", "3") == RewardResult(0.0, "parse_error")
    # a malformed gold still compares (math-verify falls back to its string) instead of raising
    assert math_reward("<answer>\\boxed{3}</answer>", "\\frac{") == RewardResult(0.0, "not_equivalent")


def test_math_reward_works_off_the_main_thread() -> None:
    """math-verify's signal timeout raises in threads; the reward must still verify there."""
    results: list[RewardResult] = []
    worker = threading.Thread(target=lambda: results.append(math_reward("\\boxed{0.5}", "\\frac{1}{2}")))
    worker.start()
    worker.join()
    assert results == [RewardResult(1.0, "equivalent")]


def test_registry_and_factory() -> None:
    assert set(REWARD_FNS) == {"deepsearch", "f1", "em", "math"}
    for kind in REWARD_FNS:
        fn = make_reward_fn(RewardConfig(kind=kind))
        assert isinstance(fn, RewardFn)
    fn = make_reward_fn(RewardConfig(format_penalty=-2.0, tool_bonus=0.5, required_tools=["search"]))
    assert fn("<answer>Bern</answer>", ["Bern"]) == RewardResult(
        -2.0, "no_boxed", {"f1": 0.0, "em": 0.0, "format_ok": 0.0, "tool_bonus": 0.0}
    )
    assert fn(transcript("\\boxed{Bern}", ("search",)), ["Bern"], ("search",)).score == 1.5
    assert pickle.loads(pickle.dumps(fn))(transcript("\\boxed{Bern}"), "Bern").score == 1.5


SNIPPET_ANSWER = "<think>look it up</think><search>capital of France</search>" + result_block(
    "Paris is the capital. Answer: \\boxed{Paris}", 1000) + "<think>I am not sure</think>"


@pytest.mark.parametrize("fn", [em_reward, f1_reward, deepsearch_reward])
def test_answer_in_a_tool_result_gets_no_credit(fn: RewardFn) -> None:
    """A search snippet's \\boxed{} is not the model's answer: the model text has none, so no credit."""
    assert predicted_answer(SNIPPET_ANSWER) is None
    model_text = "<think>look it up</think><search>capital of France</search><think>I am not sure</think>"
    for kwargs in ({}, {"model_text": model_text}):
        res = fn(SNIPPET_ANSWER, ["Paris"], ("search",), **kwargs)
        assert res.score <= 0.0 and res.details.get("em", 0.0) == 0.0, (kwargs, res)


def test_math_answer_in_a_tool_result_gets_no_credit() -> None:
    text = "<python>print(6*7)</python>" + result_block("\\boxed{42}", 100) + "<think>done</think>"
    assert math_reward(text, "42") == RewardResult(0.0, "no_answer")
    assert math_reward(text, "42", model_text="<python>print(6*7)</python><think>done</think>") == RewardResult(
        0.0, "no_answer")


def test_model_text_is_where_the_answer_is_read() -> None:
    """The format check reads the full transcript; the answer only the model's segments."""
    full = transcript("\\boxed{Bern}", ("search",))
    model_only = full.replace("\n<result>\nout\n</result>\n", "")
    assert deepsearch_reward(full, ["Bern"], ("search",), model_text=model_only, required_tools=("search",)
                             ).score == pytest.approx(1.1)
    # model text without the answer: no credit even though the transcript has one
    assert em_reward(full, ["Bern"], model_text="<think>plan</think>").score == 0.0


_PATHOLOGICAL_SCRIPT = r"""
import threading, time
from aepo_core.rewards import math_reward
out = {}
def score():
    out["warm"] = math_reward("\\boxed{0.5}", "\\frac{1}{2}", timeout_s=2.0)  # starts the verifier
    t0 = time.perf_counter()
    out["slow"] = math_reward("\\boxed{9^{9^{9}}}", "5", timeout_s=1.0)  # 9^387420489: minutes of big-int work
    out["slow_s"] = time.perf_counter() - t0
    out["after"] = math_reward("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", timeout_s=2.0)
worker = threading.Thread(target=score)  # off the main thread, as in a Prefect task
worker.start()
worker.join()
print(out["warm"].reason, out["slow"].reason, out["after"].reason, round(out["slow_s"], 2))
"""


def test_math_reward_timeout_bounds_a_pathological_answer_off_the_main_thread() -> None:
    """math-verify on ``9^{9^{9}}`` computes a 370-million-digit integer holding the GIL: a thread cannot even be
    abandoned.  The comparison is bounded by ``timeout_s`` and the next answer is verified as usual."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _PATHOLOGICAL_SCRIPT], capture_output=True, text=True, timeout=30,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warm, slow, after, slow_s = proc.stdout.split()
    assert (warm, slow, after) == ("equivalent", "timeout", "equivalent")
    assert float(slow_s) < 5.0
