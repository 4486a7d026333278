"""Synthetic agentic task: deterministic per seed, split by company, every question answered by the oracle with
the real BM25 search tool and the real Python sandbox, its transcripts in the protocol and scoring full reward."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from aepo_core.config import DataConfig, RewardConfig, SyntheticDataConfig
from aepo_core.protocol import (
    STOP_STRINGS,
    SYSTEM_PROMPT,
    check_format,
    extract_boxed,
    format_transcript,
    parse_tool_call,
    result_block,
    tool_calls_in,
)
from aepo_core.rewards import deepsearch_reward
from aepo_core.tool_config import PythonToolConfig, SearchToolConfig
from infra.data.rows import QuestionRow
from infra.data.synthetic import (
    COMPANY_SUFFIXES,
    FAMILIES,
    MODEL,
    RESERVED_WORDS,
    SPLITS,
    TOOL,
    OracleError,
    SyntheticTask,
    expected_reward,
    oracle_transcript,
    read_fact,
)
from infra.tools.sandbox.tool import PythonSandbox
from infra.tools.search import Bm25Backend, SearchTool

SMALL = 12  # companies in the world the oracle is run on (every question, all splits)
RESULT_CHARS = 4000
TOOL_BONUS = RewardConfig().tool_bonus


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(PythonToolConfig(cpu_seconds=5, memory_mb=512), timeout_s=20.0)


def _search_tool(task: SyntheticTask, index_dir: Path) -> SearchTool:
    return SearchTool(Bm25Backend(task.documents(), index_dir), SearchToolConfig(top_k=3), timeout_s=10.0)


@pytest.fixture(scope="module")
def small_task() -> SyntheticTask:
    return SyntheticTask(seed=7, n_companies=SMALL)


@pytest.fixture(scope="module")
def small_search(small_task: SyntheticTask, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchTool]:
    tool = _search_tool(small_task, tmp_path_factory.mktemp("bm25"))
    yield tool
    tool.close()


# ------------------------------------------------------------------------------------------------ determinism


def test_same_seed_same_task_different_seed_different_task() -> None:
    a, b, c = SyntheticTask(seed=3, n_companies=SMALL), SyntheticTask(seed=3, n_companies=SMALL), \
        SyntheticTask(seed=4, n_companies=SMALL)
    assert a.documents() == b.documents()
    for split in SPLITS:
        assert a.questions(split) == b.questions(split)
        assert [r.metadata for r in a.questions(split)] == [r.metadata for r in b.questions(split)]
    assert a.documents() != c.documents()
    assert a.questions("train") != c.questions("train")


def test_sizes_families_and_ids(small_task: SyntheticTask) -> None:
    rows = {split: small_task.questions(split) for split in SPLITS}
    assert {s: len(small_task.companies(s)) for s in SPLITS} == {"train": 8, "validation": 2, "test": 2}
    per_company = len(small_task.active_relations)
    assert all(len(rows[s]) == len(small_task.companies(s)) * per_company for s in SPLITS)
    every = [r for s in SPLITS for r in rows[s]]
    assert len({r.id for r in every}) == len(every)
    assert {r.family for r in every} == set(FAMILIES)
    assert all(r.data_source == "synthetic" and len(r.golds) == 1 and r.golds[0] for r in every)
    assert all(r.split == s for s in SPLITS for r in rows[s])
    assert small_task.questions("valid") == rows["validation"]
    with pytest.raises(ValueError, match="unknown split"):
        small_task.questions("holdout")


def test_no_test_company_or_founder_in_training_questions(small_task: SyntheticTask) -> None:
    world = small_task.world
    held_out = [c for s in ("validation", "test") for c in small_task.companies(s)]
    names = [c.name for c in held_out] + [c.founder for c in held_out]
    train_text = " ".join(r.question for r in small_task.questions("train"))
    assert names and not [n for n in names if n in train_text]
    train_entities = {e for r in small_task.questions("train") for e in r.metadata["entities"]}
    assert train_entities == {c.name for c in small_task.companies("train")}
    assert sorted(c.name for s in SPLITS for c in small_task.companies(s)) == sorted(world.companies)


def test_invented_names_are_unique_and_distractors_present(small_task: SyntheticTask) -> None:
    world = small_task.world
    words = [c.name.split()[0] for c in world.companies.values()] + [w for p in world.people for w in p.split()] \
        + list(world.cities) + list(world.countries)
    assert len(words) == len(set(words))
    assert not {w.lower() for w in words} & RESERVED_WORDS
    titles = [d["title"] for d in small_task.documents()]
    for company in world.companies.values():
        first = company.name.split(" ", 1)[0]
        namesakes = {t for t in titles if t.startswith(first + " ") and t != company.name}
        assert namesakes and all(t.split(" ", 1)[1] in COMPANY_SUFFIXES for t in namesakes)
        compared = [d for d in small_task.documents() if company.name in d["text"] and d["title"] != company.name]
        assert compared, f"no comparison passage names {company.name}"
    for person in world.people:
        surname = person.split()[1]
        assert any(t.endswith(" " + surname) and t != person for t in titles)
    assert all(len(d["text"]) < 400 for d in small_task.documents())  # whole passages fit a search snippet


def test_knobs_and_config() -> None:
    assert SyntheticTask.from_config(DataConfig()) == SyntheticTask()  # the config's defaults are the task's
    cfg = DataConfig(synthetic=SyntheticDataConfig(seed=5, entities=20, families=["compute"], questions_per_company=1,
                                                   near_name_distractors=2))
    task = SyntheticTask.from_config(cfg)
    rows = task.questions("train")
    assert len(rows) == len(task.companies("train")) and {r.family for r in rows} == {"compute"}
    easy = SyntheticTask(n_companies=SMALL, relations=("founded_year",), near_name_distractors=0,
                         comparison_distractors=0, templates_per_fact=1, fillers=False)
    assert all(r.metadata["relation"] == "founded_year" for r in easy.questions("test"))
    assert all(re.fullmatch(r"[A-Z][a-z]+ \w+ was founded in \d{4}\.", d["text"])
               for d in easy.documents() if "founded" in d["text"])
    dense = SyntheticTask(n_companies=SMALL, facts_per_document=3, mentions_per_fact=2)
    assert len(dense.documents()) < len(SyntheticTask(n_companies=SMALL).documents())
    for bad in ({"families": ("trivia",)}, {"templates_per_fact": 4}, {"mentions_per_fact": 3, "templates_per_fact": 2},
                {"n_companies": 2}, {"relations": ("founded_year",), "families": ("compute",)}):
        with pytest.raises(ValueError):
            SyntheticTask(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------ oracle


def _check_transcript(row: QuestionRow, segments: list[tuple[str, str]]) -> None:
    """Model segments end at a stop string and alternate with tool result blocks; the answer scores full reward."""
    roles = [role for role, _ in segments]
    assert roles == [MODEL, TOOL] * (len(segments) // 2) + [MODEL]
    for role, text in segments[:-1]:
        if role == MODEL:
            assert text.endswith(STOP_STRINGS[:2]) and parse_tool_call(text) is not None
            assert text.startswith("<think>")
        else:
            inner = text.removeprefix("\n<result>\n").removesuffix("\n</result>\n")
            assert text == result_block(inner, RESULT_CHARS)
    assert segments[-1][1].endswith("</answer>")
    text = format_transcript(segments)
    assert check_format(text).ok, check_format(text)
    assert extract_boxed(segments[-1][1]) == row.golds[0]
    calls = tool_calls_in(text)
    assert len(calls) == len(segments) // 2
    assert {c.name for c in calls} == ({"search", "python"} if row.family == "compute" else {"search"})
    reward = deepsearch_reward(text, row.golds)
    assert reward.score == pytest.approx(expected_reward(row, TOOL_BONUS))
    assert reward.score == pytest.approx(1.1 if row.family == "compute" else 1.0)


def test_oracle_answers_every_question_with_the_real_tools(
    small_task: SyntheticTask, small_search: SearchTool, sandbox: PythonSandbox
) -> None:
    search_calls: list[str] = []

    def search(query: str) -> str:
        search_calls.append(query)
        result = small_search(query)
        assert result.ok, result.text
        return result.text

    def python(code: str) -> str:
        result = sandbox(code)
        assert result.ok, result.text
        return result.text

    for split in SPLITS:
        for row in small_task.questions(split):
            _check_transcript(row, oracle_transcript(row, search, python, max_result_chars=RESULT_CHARS))
    assert all(len(q.split()) <= 5 for q in search_calls)  # short, natural queries


def test_varied_transcripts_answer_alike_in_other_words(
    small_task: SyntheticTask, small_search: SearchTool, sandbox: PythonSandbox
) -> None:
    """train.sft.varied (issue 53 §3): every varied transcript is as valid as the one-template one (same checks, full
    reward), the same row always gets the same words, and over the rows the words differ: more than one opening, query
    form and answer phrasing."""
    def search(query: str) -> str:
        return small_search(query).text

    def python(code: str) -> str:
        return sandbox(code).text

    rows = [row for split in SPLITS for row in small_task.questions(split)]
    varied = {row.id: oracle_transcript(row, search, python, max_result_chars=RESULT_CHARS, varied=True)
              for row in rows}
    for row in rows:
        _check_transcript(row, varied[row.id])
    row = rows[0]
    assert oracle_transcript(row, search, python, max_result_chars=RESULT_CHARS, varied=True) == varied[row.id]
    firsts = {segments[0][1].split("</think>")[0] for segments in varied.values()}
    finals = {segments[-1][1].split("<answer>")[1].split("\\boxed")[0] for segments in varied.values()}
    assert len({f.split()[0] for f in firsts}) >= 3 and len(finals) == 3  # "<think>I", "<think>First,", "<think>To"
    plain = [oracle_transcript(r, search, python, max_result_chars=RESULT_CHARS) for r in rows]
    assert len({segments[-1][1].split("<answer>")[1].split("\\boxed")[0] for segments in plain}) == 1


def test_oracle_is_robust_to_a_hard_corpus(tmp_path: Path) -> None:
    """Dense passages, two phrasings per fact and three namesakes + three rival passages per company."""
    task = SyntheticTask(seed=11, n_companies=SMALL, families=("single_hop", "two_hop"), facts_per_document=3,
                         mentions_per_fact=2, near_name_distractors=3, comparison_distractors=3)
    tool = _search_tool(task, tmp_path)
    try:
        for split in SPLITS:
            for row in task.questions(split):
                segments = oracle_transcript(row, lambda q: tool(q).text, lambda code: "unused")
                _check_transcript(row, segments)
    finally:
        tool.close()


def test_oracle_reads_the_results_not_the_world(small_task: SyntheticTask, small_search: SearchTool) -> None:
    row = next(r for r in small_task.questions("test") if r.metadata["relation"] == "founded_year")
    gold = row.golds[0]
    shifted = str(int(gold) + 1)

    def doctored(query: str) -> str:
        return small_search(query).text.replace(gold, shifted)

    segments = oracle_transcript(row, doctored, lambda code: "unused")
    assert extract_boxed(segments[-1][1]) == shifted
    with pytest.raises(OracleError, match="no 'founded' fact"):
        oracle_transcript(row, lambda q: f"No results found for '{q}'.", lambda code: "unused")


def test_read_fact_ignores_namesakes_and_rivals() -> None:
    text = ("Page 1: Kavo Mills: Kavo Mills was founded in 1950.\n"
            "Page 2: Zuri Labs: Kavo Labs is often confused with Zuri Labs, which was founded in 1960.\n"
            "Page 3: Kavo Labs: Founded in 1971, Kavo Labs grew quickly.")
    assert read_fact(text, "founded", "Kavo Labs") == "1971"
    assert read_fact(text, "founded", "Kavo Mills") == "1950"
    assert read_fact(text, "founder", "Kavo Labs") is None
    assert read_fact("The population of Dube is 1,204,000.", "population", "Dube") == "1204000"


def test_system_prompt_teaches_every_tag() -> None:
    for tag in ("<think>", "</think>", "<search>", "</search>", "<python>", "</python>", "<result>", "</result>",
                "<answer>", "</answer>", "\\boxed{"):
        assert tag in SYSTEM_PROMPT
    assert "print" in SYSTEM_PROMPT


def test_rows_are_frozen_and_hashable(small_task: SyntheticTask) -> None:
    row = small_task.questions("test")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.question = "x"  # type: ignore[misc]
    assert len({row, dataclasses.replace(row, metadata={})}) == 1
