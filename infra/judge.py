"""LLM-as-judge over an OpenAI-compatible chat endpoint, for answers that exact match under-credits.

Why a judge: EM/F1 miss correct answers in another form ("1987" vs "in 1987, the year…", "NYC" vs "New York").
The judge sees the question, the gold answer(s) and the model's final answer (never the reasoning or the tool
results, so it cannot be swayed by them) and answers with one word.

The prompt (:data:`JUDGE_SYSTEM_PROMPT` + :data:`JUDGE_USER_TEMPLATE`), sent with temperature 0::

    system: You are a strict grader of short factual answers. …
    user:   Question: <question>
            Gold answer(s): <gold 1> | <gold 2> …
            Predicted answer: <final answer>
            Is the predicted answer correct? Reply with exactly one word: CORRECT or INCORRECT.

Verdicts (:class:`Verdict`): ``correct`` / ``incorrect`` (parsed from the reply), ``no_answer`` (the sample
committed to no final answer: not sent), ``unparsed`` (the reply names neither word; counted incorrect) and
``error`` (the endpoint failed after retries; counted incorrect and logged).  The raw reply is kept so a run's
verdicts can be audited later; the evaluate flow stores them in its per-question Parquet.

Any server speaking ``POST /v1/chat/completions`` works (vLLM, SGLang, llama.cpp server, OpenAI).  The API key,
if needed, is read from ``$AEPO_JUDGE_API_KEY``.  Only the standard library is used (``urllib``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

API_KEY_ENV = "AEPO_JUDGE_API_KEY"
DEFAULT_MODEL = "judge"

JUDGE_SYSTEM_PROMPT = (
    "You are a strict grader of short factual answers. You are given a question, one or more gold answers and a "
    "predicted answer. The predicted answer is correct if it means the same as any gold answer (ignore case, "
    "articles, punctuation, units written differently and extra words that do not change the meaning). It is "
    "incorrect if it is different, vaguer, hedges between several answers, or is missing."
)
JUDGE_USER_TEMPLATE = (
    "Question: {question}\n"
    "Gold answer(s): {golds}\n"
    "Predicted answer: {answer}\n\n"
    "Is the predicted answer correct? Reply with exactly one word: CORRECT or INCORRECT."
)

VERDICTS = ("correct", "incorrect", "no_answer", "unparsed", "error")
_WORD_RE = re.compile(r"\b(INCORRECT|CORRECT)\b", re.IGNORECASE)
_TRANSIENT_HTTP = frozenset({408, 409, 425, 429, 500, 502, 503, 504})

Answers = dict[str, list[str | None]]  # question id → the final answer of each sample (None: no answer)


class JudgeError(RuntimeError):
    """The judge endpoint failed in a way retries cannot fix (bad URL, 4xx, malformed reply)."""


@dataclass(frozen=True)
class Verdict:
    """One judged answer: the verdict word, whether it counts as correct, and the raw reply (for audits)."""

    verdict: str
    raw: str = ""

    @property
    def correct(self) -> bool:
        return self.verdict == "correct"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "correct": self.correct}


def parse_verdict(reply: str) -> str:
    """``correct`` / ``incorrect`` from the first CORRECT/INCORRECT word of the reply, else ``unparsed``."""
    m = _WORD_RE.search(reply or "")
    if m is None:
        return "unparsed"
    return m.group(1).lower()


def chat_url(url: str) -> str:
    """The chat-completions endpoint of a base URL (``http://h:p``, ``…/v1``) or of the full endpoint itself."""
    u = url.rstrip("/")
    if u.endswith("/chat/completions"):
        return u
    if u.endswith("/v1"):
        return u + "/chat/completions"
    return u + "/v1/chat/completions"


def judge_messages(question: str, golds: Sequence[str], answer: str) -> list[dict[str, str]]:
    """The documented prompt as chat messages."""
    user = JUDGE_USER_TEMPLATE.format(question=question.strip(), golds=" | ".join(g.strip() for g in golds),
                                      answer=answer.strip())
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


class LLMJudge:
    """A judge client; thread-safe (one urllib request per call)."""

    def __init__(self, url: str, model: str | None = None, *, api_key: str | None = None, timeout_s: float = 60.0,
                 retries: int = 3, backoff_s: float = 0.5, workers: int = 4, max_tokens: int = 8) -> None:
        if not url.startswith(("http://", "https://")):
            raise JudgeError(f"judge url must start with http:// or https://; got {url!r}")
        self.url = chat_url(url)
        self.model = model or DEFAULT_MODEL
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.workers = max(1, workers)
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return f"LLMJudge({self.url!r}, model={self.model!r})"

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def complete(self, messages: list[dict[str, str]]) -> str:
        """The assistant's reply text; retries transient failures (connection errors, 429, 5xx) with backoff."""
        payload = {"model": self.model, "messages": messages, "temperature": 0.0, "max_tokens": self.max_tokens}
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                body = self._post(payload)
                return str(body["choices"][0]["message"]["content"] or "")
            except urllib.error.HTTPError as exc:
                if exc.code not in _TRANSIENT_HTTP or attempt == self.retries:
                    raise JudgeError(f"judge {self.url} answered HTTP {exc.code}: {exc.reason}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == self.retries:
                    raise JudgeError(f"judge {self.url} unreachable after {attempt + 1} tries: {exc}") from None
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise JudgeError(f"judge {self.url} sent a malformed chat completion: {exc!r}") from None
            time.sleep(delay * (1 + random.random() * 0.25))
            delay *= 2
        raise AssertionError("unreachable")

    def judge(self, question: str, golds: Sequence[str], answer: str | None) -> Verdict:
        """Judge one final answer; never raises for endpoint failures (the verdict is ``error``)."""
        if answer is None or not answer.strip():
            return Verdict("no_answer")
        try:
            reply = self.complete(judge_messages(question, golds, answer))
        except JudgeError as exc:
            log.warning("%s", exc)
            return Verdict("error", str(exc))
        return Verdict(parse_verdict(reply), reply)

    def judge_many(self, items: Sequence[tuple[str, Sequence[str], str | None]]) -> list[Verdict]:
        """Judge (question, golds, answer) triples concurrently; verdicts in input order."""
        if not items:
            return []
        with ThreadPoolExecutor(max_workers=min(self.workers, len(items))) as pool:
            verdicts = list(pool.map(lambda it: self.judge(*it), items))
        errors = sum(v.verdict == "error" for v in verdicts)
        if errors:
            log.warning("judge %s: %d of %d calls failed (counted incorrect)", self.url, errors, len(items))
        return verdicts


__all__ = [
    "API_KEY_ENV",
    "JUDGE_SYSTEM_PROMPT",
    "JUDGE_USER_TEMPLATE",
    "VERDICTS",
    "JudgeError",
    "LLMJudge",
    "Verdict",
    "chat_url",
    "judge_messages",
    "parse_verdict",
]
