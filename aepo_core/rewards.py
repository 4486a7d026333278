"""Reward functions (AEPO.md §7): deep-search format + F1 + tool bonus, EM, F1, and math equivalence.

Every reward returns a :class:`RewardResult` with a short ``reason`` id, so a run can be analysed by why
trajectories scored what they did.  No reward ever raises on model output.
"""

from __future__ import annotations

import functools
import re
import string
import threading
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

from aepo_core.config import RewardConfig
from aepo_core.interfaces import RewardFn, RewardResult
from aepo_core.protocol import check_format, extract_answer_block, extract_boxed, tool_calls_in

__all__ = [
    "REWARD_FNS",
    "deepsearch_reward",
    "em_reward",
    "exact_match",
    "extract_boxed",
    "f1_reward",
    "make_reward_fn",
    "math_reward",
    "normalize_answer",
    "predicted_answer",
    "token_f1",
]

DEFAULT_REQUIRED_TOOLS: tuple[str, ...] = ("search", "python")
# math_verify's own default; its timeout uses signal.alarm and therefore only works in the main thread.
DEFAULT_MATH_TIMEOUT_S = 5

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
# \text{X}-like wrappers whose content is the answer (no nested braces inside X).
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_ASCII_PUNCTUATION = frozenset(string.punctuation)
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")

Golds = str | Sequence[str]


def _gold_list(golds: Golds) -> list[str]:
    """One gold string or a sequence of them, as a list (a bare str is one answer, not its characters)."""
    return [golds] if isinstance(golds, str) else [str(g) for g in golds]


def _is_punctuation(ch: str) -> bool:
    """SQuAD's ASCII punctuation plus every Unicode punctuation character (curly quotes, «», 、 …)."""
    return ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P")


def normalize_answer(s: str) -> str:
    """SQuAD normalization, Unicode-aware, so equivalent spellings of an answer compare equal.

    NFKC (full-width and composed forms), unwrap ``\\text{…}``-like LaTeX wrappers, case-fold, drop
    punctuation (ASCII and Unicode, which also removes stray quote characters around a reference — the
    published harness kept them and scored references like ``"Paris"`` as wrong), drop the articles
    a/an/the, collapse whitespace.
    """
    s = unicodedata.normalize("NFKC", s)
    previous = None
    while previous != s:  # unwrap nested wrappers from the inside out
        previous, s = s, _TEXT_WRAPPER_RE.sub(r"\1", s)
    s = s.casefold()
    s = "".join(ch for ch in s if not _is_punctuation(ch))
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def exact_match(pred: str | None, golds: Golds) -> float:
    """1.0 when the normalized prediction equals any normalized gold; an empty prediction never matches."""
    if pred is None:
        return 0.0
    norm = normalize_answer(pred)
    if not norm:
        return 0.0
    return 1.0 if any(norm == normalize_answer(g) for g in _gold_list(golds)) else 0.0


def token_f1(pred: str | None, golds: Golds) -> float:
    """SQuAD token F1 of the prediction, maximised over the gold answers (0.0 for an empty prediction)."""
    if pred is None:
        return 0.0
    pred_tokens = normalize_answer(pred).split()
    if not pred_tokens:
        return 0.0
    best = 0.0
    for gold in _gold_list(golds):
        gold_tokens = normalize_answer(gold).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision = common / len(pred_tokens)
        recall = common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def predicted_answer(response_text: str) -> str | None:
    """The answer a response commits to: the boxed content of its answer block (or of the whole text when
    there is no block), else the answer block's text; None when there is neither."""
    block = extract_answer_block(response_text)
    boxed = extract_boxed(block if block is not None else response_text)
    if boxed is not None:
        return boxed
    return block


def _tools_used(response_text: str, tool_names: Sequence[str]) -> set[str]:
    """Tools named by the caller; when it names none, the calls found in the transcript itself."""
    if tool_names:
        return set(tool_names)
    return {call.name for call in tool_calls_in(response_text)}


def _graded_reason(score: float) -> str:
    if score >= 1.0:
        return "correct"
    return "partial" if score > 0.0 else "wrong"


def deepsearch_reward(
    response_text: str,
    golds: Golds,
    tool_names: Sequence[str] = (),
    *,
    format_penalty: float = -1.0,
    tool_bonus: float = 0.1,
    required_tools: Sequence[str] = DEFAULT_REQUIRED_TOOLS,
) -> RewardResult:
    """The paper's deep-search reward: ``format_penalty`` when the format check fails (reason = the check's
    reason); else token F1 of the boxed answer (max over golds), plus ``tool_bonus`` when F1 > 0 and every
    tool of ``required_tools`` was used.  ``tool_names`` are the tools called in the trajectory; when empty
    they are read from the transcript."""
    fmt = check_format(response_text)
    if not fmt.ok:
        details = {"f1": 0.0, "em": 0.0, "format_ok": 0.0, "tool_bonus": 0.0}
        return RewardResult(format_penalty, fmt.reason, details)
    pred = predicted_answer(response_text)
    f1 = token_f1(pred, golds)
    em = exact_match(pred, golds)
    used = _tools_used(response_text, tool_names)
    bonus = tool_bonus if f1 > 0.0 and all(t in used for t in required_tools) else 0.0
    details = {"f1": f1, "em": em, "format_ok": 1.0, "tool_bonus": bonus}
    return RewardResult(f1 + bonus, _graded_reason(f1), details)


def em_reward(response_text: str, golds: Golds, tool_names: Sequence[str] = ()) -> RewardResult:
    """Exact match of the predicted answer (boxed, else the answer block) against any gold."""
    pred = predicted_answer(response_text)
    if pred is None:
        return RewardResult(0.0, "no_answer", {"em": 0.0})
    em = exact_match(pred, golds)
    return RewardResult(em, "correct" if em else "wrong", {"em": em})


def f1_reward(response_text: str, golds: Golds, tool_names: Sequence[str] = ()) -> RewardResult:
    """Token F1 of the predicted answer (boxed, else the answer block), max over golds."""
    pred = predicted_answer(response_text)
    if pred is None:
        return RewardResult(0.0, "no_answer", {"f1": 0.0, "em": 0.0})
    f1 = token_f1(pred, golds)
    return RewardResult(f1, _graded_reason(f1), {"f1": f1, "em": exact_match(pred, golds)})


def _math_input(s: str) -> str:
    """math_verify only extracts delimited LaTeX: wrap a bare answer in ``$…$``."""
    return s if any(d in s for d in _MATH_DELIMITERS) else f"${s}$"


def math_reward(
    response_text: str,
    golds: Golds,
    tool_names: Sequence[str] = (),
    *,
    timeout_s: int | None = DEFAULT_MATH_TIMEOUT_S,
) -> RewardResult:
    """1.0 when the predicted answer is symbolically equivalent (math-verify) to any gold, else 0.0.

    Reasons: ``equivalent``, ``not_equivalent``, ``no_answer``, ``parse_error`` (the prediction, or every
    gold, could not be parsed, or math-verify raised).  math-verify's timeout is signal-based, so outside
    the main thread (Prefect task runners, tool pools) it runs without one.
    """
    pred = predicted_answer(response_text)
    if pred is None or not pred.strip():
        return RewardResult(0.0, "no_answer")
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    try:
        pred_parsed = mv_parse(_math_input(pred), parsing_timeout=timeout)
        gold_parsed = [mv_parse(_math_input(g), parsing_timeout=timeout) for g in _gold_list(golds)]
        gold_parsed = [g for g in gold_parsed if g]
        if not pred_parsed or not gold_parsed:
            return RewardResult(0.0, "parse_error")
        equivalent = any(mv_verify(g, pred_parsed, timeout_seconds=timeout) for g in gold_parsed)
    except Exception:  # math-verify parses untrusted model text; no parser failure may escape
        return RewardResult(0.0, "parse_error")
    return RewardResult(1.0, "equivalent") if equivalent else RewardResult(0.0, "not_equivalent")


REWARD_FNS: dict[str, Callable[..., RewardResult]] = {
    "deepsearch": deepsearch_reward,
    "f1": f1_reward,
    "em": em_reward,
    "math": math_reward,
}


def make_reward_fn(cfg: RewardConfig) -> RewardFn:
    """The reward of ``cfg.kind`` with the config's constants bound (a picklable partial)."""
    fn = REWARD_FNS[cfg.kind]
    if cfg.kind == "deepsearch":
        return functools.partial(
            fn,
            format_penalty=cfg.format_penalty,
            tool_bonus=cfg.tool_bonus,
            required_tools=tuple(cfg.required_tools),
        )
    return fn
