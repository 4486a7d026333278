"""The tag protocol of a trajectory (AEPO.md §1).

The assistant writes ``<think>…</think>``, then either a tool call ``<search>query</search>`` /
``<python>code</python>`` or the final ``<answer>… \\boxed{X} …</answer>``.  Generation of a segment stops at
a closing tool tag (or ``</answer>``); the tool's output is appended as ``<result>…</result>``.

Everything here works on text only; token bookkeeping lives in the rollout scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"
SEARCH_OPEN = "<search>"
SEARCH_CLOSE = "</search>"
PYTHON_OPEN = "<python>"
PYTHON_CLOSE = "</python>"

TOOL_NAMES: tuple[str, ...] = ("search", "python")
STOP_STRINGS: tuple[str, ...] = (SEARCH_CLOSE, PYTHON_CLOSE, ANSWER_CLOSE)
TRUNCATION_MARKER = "…[truncated]"

_TAG_NAMES: tuple[str, ...] = ("think", "answer", "result", *TOOL_NAMES)
# Any protocol tag, opening or closing; group 1 is "/" for a closing tag, group 2 the name.
TAG_RE = re.compile(r"<(/?)(" + "|".join(_TAG_NAMES) + r")>")
# \boxed or \fbox as a whole control word (not \boxedfoo).
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN_END = re.compile(r"[\s$]")


def open_tag(name: str) -> str:
    return f"<{name}>"


def close_tag(name: str) -> str:
    return f"</{name}>"


@dataclass(frozen=True)
class ToolCall:
    """One tool invocation: the tool's tag name and the (stripped) text between its tags."""

    name: str
    argument: str


@dataclass(frozen=True)
class FormatCheck:
    """Outcome of :func:`check_format`; ``reason`` is a short machine-friendly id (``ok`` when it passes)."""

    ok: bool
    reason: str


def parse_tool_call(segment_text: str, tool_names: tuple[str, ...] = TOOL_NAMES) -> ToolCall | None:
    """The tool call that a generated segment ends with, or None.

    The engine stops a segment at the first closing tool tag, so a call is recognised only when the segment
    (ignoring trailing whitespace) ends with ``</name>``; its argument starts after the LAST ``<name>`` before
    it, so stray earlier mentions of the tag and ``<``/``>`` inside code are harmless.  No closing tag, or a
    closing tag without an opening one, gives None.
    """
    body = segment_text.rstrip()
    for name in tool_names:
        closing = close_tag(name)
        if not body.endswith(closing):
            continue
        inner_end = len(body) - len(closing)
        start = body.rfind(open_tag(name), 0, inner_end)
        if start < 0:
            return None
        return ToolCall(name, body[start + len(open_tag(name)) : inner_end].strip())
    return None


def result_block(text: str, max_chars: int) -> str:
    """The text appended after a tool call: ``\\n<result>\\n{text}\\n</result>\\n``.

    ``text`` is cut to ``max_chars`` characters and then marked with :data:`TRUNCATION_MARKER` so the model
    (and a reader of the trajectory) can tell that it did not see everything.
    """
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    if len(text) > max_chars:
        text = text[:max_chars] + TRUNCATION_MARKER
    # A tool's own output must not be able to close (or open) the result block early.
    text = text.replace(RESULT_CLOSE, "</ result>").replace(RESULT_OPEN, "< result>")
    return f"\n{RESULT_OPEN}\n{text}\n{RESULT_CLOSE}\n"


def extract_answer_block(text: str) -> str | None:
    """Stripped content of the last complete ``<answer>…</answer>`` block, or None when there is none.

    The block starts at the last ``<answer>`` before its ``</answer>``, so a stray earlier opening tag is not
    swallowed into the answer.
    """
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN) : end].strip()


def extract_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{…}`` (or ``\\fbox{…}``) in ``text``, stripped; None when absent.

    Braces nest (``\\boxed{\\frac{a}{b}}`` → ``\\frac{a}{b}``); escaped braces ``\\{``/``\\}`` do not count.
    The brace-less form ``\\boxed 5`` takes the token up to whitespace or ``$``.  Only the last occurrence
    is considered: if it is malformed (unbalanced braces, nothing after it) the result is None rather than an
    earlier, superseded answer.
    """
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    pos = matches[-1].end()
    if pos < len(text) and text[pos] != "{":
        # `\boxed 5` or `\boxed {5}`: skip the whitespace after the control word.
        rest = text[pos:]
        stripped = rest.lstrip()
        if stripped == rest:
            return None
        pos += len(rest) - len(stripped)
        if not stripped.startswith("{"):
            end = _BARE_TOKEN_END.search(text, pos)
            token = text[pos : end.start() if end else len(text)]
            return token or None
    if pos >= len(text):
        return None
    return _braced_group(text, pos)


def _braced_group(text: str, pos: int) -> str | None:
    """Content of the brace group opening at ``text[pos] == '{'``; None when it never closes."""
    depth = 0
    i = pos
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character (\{, \}, \\) never changes the depth
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i].strip()
        i += 1
    return None


def tool_calls_in(text: str, tool_names: tuple[str, ...] = TOOL_NAMES) -> list[ToolCall]:
    """Every tool call of a full transcript, in order, as the engine would have executed them (see
    :func:`tool_call_spans`)."""
    return [call for _start, _end, call in tool_call_spans(text, tool_names)]


def tool_call_spans(text: str, tool_names: tuple[str, ...] = TOOL_NAMES) -> list[tuple[int, int, ToolCall]]:
    """Every tool call of a full transcript with its characters: ``(start, end, call)``, ``text[start:end]`` running
    from the call's opening tag through its closing tag.

    The transcript is cut where generation would have stopped (each closing tool tag) and after every
    ``</result>``; each piece is parsed with :func:`parse_tool_call`.  Result contents are skipped: tool
    output is not model text, and a search snippet that happens to contain tags must not count as a call.
    """
    spans: list[tuple[int, int, ToolCall]] = []
    segment_start = 0
    pos = 0
    closings = {close_tag(name) for name in tool_names}
    while True:
        match = TAG_RE.search(text, pos)
        if match is None:
            return spans
        tag = match.group(0)
        if tag == RESULT_OPEN:
            end = text.find(RESULT_CLOSE, match.end())
            if end < 0:
                return spans
            pos = segment_start = end + len(RESULT_CLOSE)
            continue
        pos = match.end()
        if tag in closings:
            call = parse_tool_call(text[segment_start:pos], tool_names)
            if call is not None:
                spans.append((text.rfind(open_tag(call.name), segment_start, match.start()), pos, call))
            segment_start = pos


def check_format(response_text: str, *, allow_text_outside_blocks: bool = False) -> FormatCheck:
    """Deep-search format check (AEPO.md §7). Lenient about whitespace, strict about structure.

    The response must be a sequence of top-level blocks separated only by whitespace:

    - ``<think>…</think>``: optional, any number; every one closed (``unbalanced_think``), none inside
      another (``nested_think``), and no answer/tool/result tag inside (``tag_inside_think``: the engine
      would have executed a tool call there).
    - a tool call ``<search>…</search>`` / ``<python>…</python>`` (content opaque, so code may contain
      ``<``/``>``), immediately followed by a ``<result>…</result>`` block (``tool_call_without_result``;
      ``unclosed_tool_call`` when the closing tag is missing).
    - ``<result>…</result>``: content opaque (tool output); only right after a tool call
      (``result_without_tool_call``); closed (``unclosed_result``).
    - exactly one ``<answer>…</answer>`` (``no_answer``, ``multiple_answers``, ``unclosed_answer``), last
      (``text_after_answer``), containing a ``\\boxed{…}`` (``no_boxed``) and no other protocol tag
      (``tag_inside_answer``).

    A stray closing tag gives ``unbalanced_<name>``.  Non-whitespace text between blocks gives
    ``text_outside_blocks`` unless ``allow_text_outside_blocks``.  The first violation in reading order is
    reported.
    """
    pos = 0
    awaiting_result = False
    answered = False
    while True:
        match = TAG_RE.search(response_text, pos)
        gap = response_text[pos : match.start() if match else len(response_text)]
        if gap.strip():
            if answered:
                return FormatCheck(False, "text_after_answer")
            if awaiting_result:
                return FormatCheck(False, "tool_call_without_result")
            if not allow_text_outside_blocks:
                return FormatCheck(False, "text_outside_blocks")
        if match is None:
            break
        closing, name = match.group(1) == "/", match.group(2)
        if answered:
            again = name == "answer" and not closing
            return FormatCheck(False, "multiple_answers" if again else "text_after_answer")
        if awaiting_result and not (name == "result" and not closing):
            return FormatCheck(False, "tool_call_without_result")
        if closing:
            return FormatCheck(False, f"unbalanced_{name}")
        if name == "result" and not awaiting_result:
            return FormatCheck(False, "result_without_tool_call")
        awaiting_result = False
        end_or_reason = _block_end(response_text, match.end(), name)
        if isinstance(end_or_reason, str):
            return FormatCheck(False, end_or_reason)
        content = response_text[match.end() : end_or_reason]
        pos = end_or_reason + len(close_tag(name))
        if name in TOOL_NAMES:
            awaiting_result = True
        elif name == "answer":
            if extract_boxed(content) is None:
                return FormatCheck(False, "no_boxed")
            answered = True
    if awaiting_result:
        return FormatCheck(False, "tool_call_without_result")
    if not answered:
        return FormatCheck(False, "no_answer")
    return FormatCheck(True, "ok")


def _block_end(text: str, content_start: int, name: str) -> int | str:
    """Index of the closing tag of a block whose content starts at ``content_start``, or a failure reason.

    Tool-call and result contents are opaque (code and tool output may contain anything); think and answer
    contents are model prose, so a protocol tag inside them is a structural error.
    """
    closing = close_tag(name)
    if name == "result" or name in TOOL_NAMES:
        end = text.find(closing, content_start)
        if end < 0:
            return "unclosed_result" if name == "result" else "unclosed_tool_call"
        return end
    if text.find(closing, content_start) < 0:
        return "unbalanced_think" if name == "think" else "unclosed_answer"
    inner = TAG_RE.search(text, content_start)
    assert inner is not None  # at worst it is the closing tag found above
    if inner.group(0) == closing:
        return inner.start()
    if name == "think":
        return "nested_think" if inner.group(0) == THINK_OPEN else "tag_inside_think"
    if inner.group(0) == ANSWER_OPEN:
        return "multiple_answers"
    return "tag_inside_answer"


# The instruction that teaches the tag protocol (used as the system prompt for SFT data, RL and evaluation, so
# the model sees the same contract everywhere).  Short on purpose: small models are trained and run with it.
SYSTEM_PROMPT = (
    "Answer the user's question. Think step by step inside <think> </think>. "
    "To look something up, write <search>query</search>. "
    "To calculate, write <python>code</python> and print the result. "
    "Each tool call is answered by its output inside <result> </result>. "
    "Call tools as often as needed, then give the final answer as "
    "<answer>The answer is \\boxed{ANSWER}.</answer>"
)


PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class AgentProtocol:
    """What makes a policy an agent of this protocol beyond its weights: the system prompt its rollouts start with,
    the tools it may call and the strings that end a generated segment. A logged policy carries it (MLflow model
    metadata) so that evaluating or serving it starts from the prompt it was trained on."""

    system_prompt: str | None = SYSTEM_PROMPT
    tools: tuple[str, ...] = TOOL_NAMES
    stop_strings: tuple[str, ...] = STOP_STRINGS
    version: int = PROTOCOL_VERSION

    def as_dict(self) -> dict[str, object]:
        return {"version": self.version, "system_prompt": self.system_prompt, "tools": list(self.tools),
                "stop_strings": list(self.stop_strings)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str) -> AgentProtocol:
        """The protocol :meth:`as_dict` wrote; a ``ValueError`` naming ``source`` and the field when it is not one
        this code runs (another version, other tools or stop strings: the rollout loop would not match it)."""
        try:
            prompt, tools, stops, version = (data["system_prompt"], data["tools"], data["stop_strings"],
                                             data["version"])
        except KeyError as exc:
            raise ValueError(f"{source}: the agent protocol has no {exc.args[0]!r}") from None
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"{source}: agent protocol system_prompt must be a string or null")
        found = cls(prompt, tuple(map(str, tools)) if isinstance(tools, list) else (),
                    tuple(map(str, stops)) if isinstance(stops, list) else (), int(str(version)))
        for name, theirs, ours in (("version", found.version, PROTOCOL_VERSION), ("tools", found.tools, TOOL_NAMES),
                                   ("stop_strings", found.stop_strings, STOP_STRINGS)):
            if theirs != ours:
                raise ValueError(f"{source}: agent protocol {name} {theirs!r} differs from this code's {ours!r}")
        return found


def chat_messages(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The chat of one rollout prompt: the tag-protocol system prompt (None: none) and the question as the user turn.

    Training, SFT transcripts, evaluation and the benchmarks all start from these messages, so the model sees one
    prompt everywhere; ``infra.models.chat_prompt_ids`` turns them into token ids through the chat template.
    """
    messages = [{"role": "user", "content": question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def format_transcript(segments: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """The full response text of ``(role, text)`` segments (model text and tool result blocks), in order.

    Segments already carry their exact text (tool segments are :func:`result_block` output), so joining
    without separators reproduces what the model saw and what :func:`check_format` and rewards score.
    """
    return "".join(text for _, text in segments)
