"""Reward functions (AEPO.md §7): deep-search format + F1 + tool bonus, EM, F1, and math equivalence.

Every reward returns a :class:`RewardResult` with a short ``reason`` id, so a run can be analysed by why
trajectories scored what they did.  No reward ever raises on model output.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import re
import string
import threading
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

from aepo_core.config import RewardConfig
from aepo_core.interfaces import RewardFn, RewardResult
from aepo_core.protocol import (
    RESULT_CLOSE,
    RESULT_OPEN,
    check_format,
    extract_answer_block,
    extract_boxed,
    tool_calls_in,
)

__all__ = [
    "REWARD_FNS",
    "deepsearch_reward",
    "em_reward",
    "exact_match",
    "extract_boxed",
    "f1_reward",
    "make_reward_fn",
    "math_reward",
    "model_written",
    "normalize_answer",
    "predicted_answer",
    "token_f1",
]

DEFAULT_REQUIRED_TOOLS: tuple[str, ...] = ("search", "python")
# Wall-clock bound of one answer's math-verify comparison (RewardConfig.math_timeout_s).
DEFAULT_MATH_TIMEOUT_S = 5.0
# Seconds a fresh verifier process may take to start (import sympy and math-verify) before it counts as failed.
_MATH_WORKER_START_S = 120.0

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
# \text{X}-like wrappers whose content is the answer (no nested braces inside X).
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_ASCII_PUNCTUATION = frozenset(string.punctuation)
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
# A tool result block; an unclosed one (a transcript cut inside it) runs to the end.
_RESULT_BLOCK_RE = re.compile(re.escape(RESULT_OPEN) + r".*?(?:" + re.escape(RESULT_CLOSE) + r"|\Z)", re.DOTALL)

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


def model_written(response_text: str) -> str:
    """The transcript without its tool results (``<result>…</result>`` blocks, which a tool's output cannot close
    early, :func:`~aepo_core.protocol.result_block`): what the model wrote."""
    return _RESULT_BLOCK_RE.sub("", response_text)


def predicted_answer(model_text: str) -> str | None:
    """The answer the model commits to: the boxed content of its answer block (or of all its text when there is
    no block), else the answer block's text; None when there is neither.

    Only model-written text is read: ``model_text`` should be the model's segments (scoring passes them); any
    ``<result>`` block left in it is removed first (:func:`model_written`), so a search snippet's ``\\boxed{}``
    is never taken for the answer."""
    text = model_written(model_text)
    block = extract_answer_block(text)
    boxed = extract_boxed(block if block is not None else text)
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
    model_text: str | None = None,
    format_penalty: float = -1.0,
    tool_bonus: float = 0.1,
    required_tools: Sequence[str] = DEFAULT_REQUIRED_TOOLS,
) -> RewardResult:
    """The paper's deep-search reward: ``format_penalty`` when the format check (of the whole transcript) fails
    (reason = the check's reason); else token F1 of the boxed answer in ``model_text`` (max over golds), plus
    ``tool_bonus`` when F1 > 0 and every tool of ``required_tools`` was used.  ``tool_names`` are the tools
    called in the trajectory; when empty they are read from the transcript."""
    fmt = check_format(response_text)
    if not fmt.ok:
        details = {"f1": 0.0, "em": 0.0, "format_ok": 0.0, "tool_bonus": 0.0}
        return RewardResult(format_penalty, fmt.reason, details)
    pred = predicted_answer(_answer_text(response_text, model_text))
    f1 = token_f1(pred, golds)
    em = exact_match(pred, golds)
    used = _tools_used(response_text, tool_names)
    bonus = tool_bonus if f1 > 0.0 and all(t in used for t in required_tools) else 0.0
    details = {"f1": f1, "em": em, "format_ok": 1.0, "tool_bonus": bonus}
    return RewardResult(f1 + bonus, _graded_reason(f1), details)


def em_reward(response_text: str, golds: Golds, tool_names: Sequence[str] = (), *,
              model_text: str | None = None) -> RewardResult:
    """Exact match of the predicted answer (boxed, else the answer block) against any gold."""
    pred = predicted_answer(_answer_text(response_text, model_text))
    if pred is None:
        return RewardResult(0.0, "no_answer", {"em": 0.0})
    em = exact_match(pred, golds)
    return RewardResult(em, "correct" if em else "wrong", {"em": em})


def f1_reward(response_text: str, golds: Golds, tool_names: Sequence[str] = (), *,
              model_text: str | None = None) -> RewardResult:
    """Token F1 of the predicted answer (boxed, else the answer block), max over golds."""
    pred = predicted_answer(_answer_text(response_text, model_text))
    if pred is None:
        return RewardResult(0.0, "no_answer", {"f1": 0.0, "em": 0.0})
    f1 = token_f1(pred, golds)
    return RewardResult(f1, _graded_reason(f1), {"f1": f1, "em": exact_match(pred, golds)})


def _answer_text(response_text: str, model_text: str | None) -> str:
    """Where the answer is read: the model's segments when given, else the transcript (whose tool results
    :func:`predicted_answer` removes)."""
    return model_text if model_text is not None else response_text


def _math_input(s: str) -> str:
    """math_verify only extracts delimited LaTeX: wrap a bare answer in ``$…$``."""
    return s if any(d in s for d in _MATH_DELIMITERS) else f"${s}$"


def _math_equivalence(pred: str, golds: Sequence[str]) -> str:
    """``equivalent`` / ``not_equivalent`` / ``parse_error``, with no time limit of its own (the caller bounds it:
    math-verify's timeout is signal-based, only works in a main thread and cannot stop C-level big-integer work)."""
    try:
        pred_parsed = mv_parse(_math_input(pred), parsing_timeout=None)
        gold_parsed = [mv_parse(_math_input(g), parsing_timeout=None) for g in golds]
        gold_parsed = [g for g in gold_parsed if g]
        if not pred_parsed or not gold_parsed:
            return "parse_error"
        equivalent = any(mv_verify(g, pred_parsed, timeout_seconds=None) for g in gold_parsed)
    except Exception:  # math-verify parses untrusted model text; no parser failure may escape
        return "parse_error"
    return "equivalent" if equivalent else "not_equivalent"


def _serve_math(conn: Connection) -> None:
    """The verifier process: answers ``(pred, golds)`` requests with :func:`_math_equivalence` until its pipe
    closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the parent bounds it
    conn.send("ready")
    while True:
        try:
            pred, golds = conn.recv()
        except EOFError:
            return
        conn.send(_math_equivalence(pred, golds))


class _MathVerifier:
    """math-verify in a child process (spawned once, reused), so one comparison is bounded in wall-clock time from
    any thread: on timeout the process is killed, and the next comparison starts a fresh one.  A thread could not
    be abandoned instead: ``9^{9^{9}}`` makes sympy build a 370-million-digit integer while holding the GIL."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None

    def compare(self, pred: str, golds: Sequence[str], timeout_s: float) -> str:
        """:func:`_math_equivalence`, or ``timeout`` after ``timeout_s`` seconds (``parse_error`` if the verifier
        process died on the input)."""
        with self._lock:
            conn = self._connection()
            try:
                conn.send((pred, list(golds)))
                if conn.poll(timeout_s):
                    return str(conn.recv())
            except (EOFError, OSError):
                self.close()
                return "parse_error"
            self.close()
            return "timeout"

    def _connection(self) -> Connection:
        if self._conn is None or self._proc is None or not self._proc.is_alive():
            self.close()
            ctx = multiprocessing.get_context("spawn")  # no fork of a threaded (torch, Prefect) parent
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_math, args=(child,), name="aepo-math-verify", daemon=True)
            proc.start()
            child.close()
            if not parent.poll(_MATH_WORKER_START_S) or parent.recv() != "ready":
                proc.kill()
                raise RuntimeError(f"the math-verify process did not start within {_MATH_WORKER_START_S:.0f} s")
            self._proc, self._conn = proc, parent
        return self._conn

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None


_MATH_VERIFIER = _MathVerifier()
atexit.register(_MATH_VERIFIER.close)


def math_reward(
    response_text: str,
    golds: Golds,
    tool_names: Sequence[str] = (),
    *,
    model_text: str | None = None,
    timeout_s: float | None = DEFAULT_MATH_TIMEOUT_S,
) -> RewardResult:
    """1.0 when the predicted answer is symbolically equivalent (math-verify) to any gold, else 0.0.

    Reasons: ``equivalent``, ``not_equivalent``, ``no_answer``, ``parse_error`` (the prediction, or every gold,
    could not be parsed, or math-verify raised), ``timeout`` (the comparison took more than ``timeout_s``
    seconds).  The comparison runs in a verifier process (:class:`_MathVerifier`), so the bound holds in any
    thread; ``timeout_s=None`` (or a daemonic process, which may not start one) compares in-process, unbounded.
    """
    pred = predicted_answer(_answer_text(response_text, model_text))
    if pred is None or not pred.strip():
        return RewardResult(0.0, "no_answer")
    gold_list = _gold_list(golds)
    if timeout_s is None or multiprocessing.current_process().daemon:
        reason = _math_equivalence(pred, gold_list)
    else:
        reason = _MATH_VERIFIER.compare(pred, gold_list, timeout_s)
    return RewardResult(1.0 if reason == "equivalent" else 0.0, reason)


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
    if cfg.kind == "math":
        return functools.partial(fn, timeout_s=cfg.math_timeout_s)
    return fn
