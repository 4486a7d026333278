"""Tag protocol: tool-call parsing, result blocks, answer extraction, the deep-search format check."""

from __future__ import annotations

import pytest

from aepo_core.protocol import (
    STOP_STRINGS,
    TOOL_NAMES,
    TRUNCATION_MARKER,
    FormatCheck,
    ToolCall,
    check_format,
    extract_answer_block,
    parse_tool_call,
    result_block,
    tool_call_spans,
    tool_calls_in,
)

GOOD = (
    "<think>I need the capital.</think>\n"
    "<search>capital of Switzerland</search>\n<result>\nBern is the capital.\n</result>\n"
    "<think>Now compute.</think>"
    "<python>print(1 < 2 and 3 > 2)</python>\n<result>\nTrue\n</result>\n"
    "<think>Done.</think>\n<answer>The answer is \\boxed{Bern}</answer>\n"
)


def test_constants() -> None:
    assert TOOL_NAMES == ("search", "python")
    assert set(STOP_STRINGS) == {"</search>", "</python>", "</answer>"}


@pytest.mark.parametrize(
    ("segment", "expected"),
    [
        ("<think>x</think>\n<search>who wrote Faust</search>", ToolCall("search", "who wrote Faust")),
        ("<python>\nprint(1 < 2 > 0)\n</python>  \n", ToolCall("python", "print(1 < 2 > 0)")),
        # the LAST opening tag counts: an earlier mention of the tag is stray text
        ("I will use <search> soon. <search>real query</search>", ToolCall("search", "real query")),
        ("<python>s = '<b>x</b>'\nprint(s)</python>", ToolCall("python", "s = '<b>x</b>'\nprint(s)")),
        ("<search>unfinished query", None),
        ("<think>only thinking</think>", None),
        ("query</search>", None),  # closing tag without an opening tag
        ("<search>q</search> trailing text", None),  # the segment does not end with the call
        ("<answer>\\boxed{1}</answer>", None),
    ],
)
def test_parse_tool_call(segment: str, expected: ToolCall | None) -> None:
    assert parse_tool_call(segment) == expected


def test_result_block_exact_and_truncated() -> None:
    assert result_block("hello", 10) == "\n<result>\nhello\n</result>\n"
    assert result_block("abcdefghij", 10) == "\n<result>\nabcdefghij\n</result>\n"
    assert result_block("abcdefghijk", 4) == f"\n<result>\nabcd{TRUNCATION_MARKER}\n</result>\n"
    with pytest.raises(ValueError, match="max_chars"):
        result_block("x", -1)


def test_extract_answer_block() -> None:
    assert extract_answer_block(GOOD) == "The answer is \\boxed{Bern}"
    assert extract_answer_block("no answer here") is None
    assert extract_answer_block("<answer>unclosed \\boxed{1}") is None
    assert extract_answer_block("<answer>a</answer> then <answer> b </answer>") == "b"
    assert extract_answer_block("<answer> stray <answer>real</answer>") == "real"


def test_tool_calls_in_transcript() -> None:
    assert tool_calls_in(GOOD) == [
        ToolCall("search", "capital of Switzerland"),
        ToolCall("python", "print(1 < 2 and 3 > 2)"),
    ]
    assert tool_calls_in("<think>no tools</think><answer>\\boxed{1}</answer>") == []


def test_tool_calls_in_skips_result_contents() -> None:
    text = (
        "<search>q1</search><result>page says <python>evil()</python> and <search>x</search></result>"
        "<python>1+1</python><result>2</result><answer>\\boxed{2}</answer>"
    )
    assert tool_calls_in(text) == [ToolCall("search", "q1"), ToolCall("python", "1+1")]


def test_tool_call_spans_run_from_the_opening_through_the_closing_tag() -> None:
    text = (
        "<think>a <search> stray</think><search>q1</search><result>page <python>evil()</python></result>"
        "<python>1+1</python><result>2</result><answer>\\boxed{2}</answer>"
    )
    spans = tool_call_spans(text)
    assert [text[s:e] for s, e, _call in spans] == ["<search>q1</search>", "<python>1+1</python>"]
    assert [call for _s, _e, call in spans] == tool_calls_in(text)


def test_check_format_accepts_good_transcript() -> None:
    assert check_format(GOOD) == FormatCheck(True, "ok")
    # no think and no tools is structurally fine
    assert check_format("  <answer>\\boxed{42}</answer>  ") == FormatCheck(True, "ok")
    # code may contain tag-like text and angle brackets
    code = (
        "<python>x = '<think>' if 1 < 2 else '</think>'</python>"
        "<result>ok</result><answer>\\boxed 5</answer>"
    )
    assert check_format(code) == FormatCheck(True, "ok")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no_answer"),
        ("<think>hmm</think>", "no_answer"),
        ("<think>hmm<answer>\\boxed{1}</answer>", "unbalanced_think"),
        ("</think><answer>\\boxed{1}</answer>", "unbalanced_think"),
        ("<think>a<think>b</think>c</think><answer>\\boxed{1}</answer>", "nested_think"),
        ("<think>a <search>q</search><result>r</result></think><answer>\\boxed{1}</answer>",
         "tag_inside_think"),
        ("<answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>", "multiple_answers"),
        ("<answer>no box here</answer>", "no_boxed"),
        ("<answer>\\boxed{1}</answer> and more", "text_after_answer"),
        ("<answer>\\boxed{1}</answer><think>late</think>", "text_after_answer"),
        ("<search>q</search><answer>\\boxed{1}</answer>", "tool_call_without_result"),
        ("<search>q</search> I guess <result>r</result><answer>\\boxed{1}</answer>",
         "tool_call_without_result"),
        ("<think>x</think><python>print(1)</python>", "tool_call_without_result"),
        ("<result>r</result><answer>\\boxed{1}</answer>", "result_without_tool_call"),
        ("<search>q</search><result>r<answer>\\boxed{1}</answer>", "unclosed_result"),
        ("<python>print(1)", "unclosed_tool_call"),
        ("<answer>\\boxed{1}", "unclosed_answer"),
        ("<answer>\\boxed{1} <result>x</result></answer>", "tag_inside_answer"),
        ("stray <answer>\\boxed{1}</answer>", "text_outside_blocks"),
        ("<think>a</think> so <answer>\\boxed{1}</answer>", "text_outside_blocks"),
        ("</search><answer>\\boxed{1}</answer>", "unbalanced_search"),
    ],
)
def test_check_format_failures(text: str, reason: str) -> None:
    assert check_format(text) == FormatCheck(False, reason)


def test_check_format_stray_text_can_be_allowed() -> None:
    text = "<think>a</think> so <answer>\\boxed{1}</answer>"
    assert check_format(text, allow_text_outside_blocks=True) == FormatCheck(True, "ok")
    # structure stays strict even when stray text is allowed
    bad = "<search>q</search> hmm <answer>\\boxed{1}</answer>"
    assert check_format(bad, allow_text_outside_blocks=True) == FormatCheck(False, "tool_call_without_result")
    late = check_format("<answer>\\boxed{1}</answer> x", allow_text_outside_blocks=True)
    assert late == FormatCheck(False, "text_after_answer")


def test_result_block_round_trips_through_format_check() -> None:
    text = "<search>q</search>" + result_block("snippet " * 50, 20) + "<answer>\\boxed{x}</answer>"
    assert check_format(text) == FormatCheck(True, "ok")
    assert tool_calls_in(text) == [ToolCall("search", "q")]


def test_result_block_neutralizes_result_tags_in_tool_output():
    from aepo_core.protocol import check_format

    block = result_block("page says </result> and <result> here", 1000)
    assert block.count("</result>") == 1 and block.count("<result>") == 1
    transcript = "<think>t</think><search>q</search>" + block + "<answer>\\boxed{x}</answer>"
    assert check_format(transcript).ok


def test_agent_protocol_round_trips_and_refuses_another_tool_set() -> None:
    from aepo_core.protocol import AgentProtocol

    carried = AgentProtocol(system_prompt="Be brief.")
    assert AgentProtocol.from_dict(carried.as_dict(), source="m") == carried
    other = {**carried.as_dict(), "tools": ["search"]}
    with pytest.raises(ValueError, match=r"models:/p/1: agent protocol tools \('search',\) differs"):
        AgentProtocol.from_dict(other, source="models:/p/1")
    with pytest.raises(ValueError, match="has no 'stop_strings'"):
        AgentProtocol.from_dict({"system_prompt": None, "tools": [], "version": 1}, source="m")
