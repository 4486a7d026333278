"""Dataset loaders: the ARPO data ships inside the package unchanged (its digests) and every file loads (the
backspace-for-\\b defect repaired), malformed rows made here are reported by index and field or skipped exactly, HF
`datasets` saves load, specs resolve, and the recorded search results become a BM25 corpus."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from aepo_core.tool_config import SearchToolConfig
from infra.data.loaders import (
    DATA_ROOT_ENV,
    dataset_key,
    default_data_root,
    load_dataset_rows,
    load_hf_dataset_files,
    load_jsonl_benchmark,
    load_search_corpus,
    load_verl_parquet,
    read_dataset,
    repair_text,
    resolve_spec,
    shipped_names,
)
from infra.data.rows import BadRow, BadRowError, QuestionRow
from infra.data.synthetic import SyntheticTask
from infra.tools.search import Bm25Backend, SearchTool

DATA_ROOT = default_data_root()
SHIPPED = shipped_names(DATA_ROOT)
REPO = Path(__file__).resolve().parents[2]
# train_10k.parquet ships one question whose ground truth is blank.
TRAIN_10K_BLANK_ANSWER_ROW = 5274
SYSTEM = "Put the answer in \x08oxed{}, e.g. \\[ \x08oxed{42} \\]."


def _raw_row_count(path: Path) -> int:
    if path.suffix == ".parquet":
        return pq.read_metadata(path).num_rows
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


# ------------------------------------------------------------------------------------------------ shipped data


def test_the_data_ships_inside_the_package_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default data root is the package's own copy, so a clone made anywhere (no ``../shared`` beside it) and an
    installed wheel resolve the names; every file is the one released (SHA256SUMS), and every name resolves."""
    monkeypatch.delenv(DATA_ROOT_ENV, raising=False)
    root = default_data_root()
    assert root == REPO / "infra" / "data" / "arpo"
    listed = dict(reversed(line.split("  ", 1)) for line in (root / "SHA256SUMS").read_text().splitlines())
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.is_file() and p.name not in ("SHA256SUMS", "README.md", "LICENSE")}
    assert set(listed) == on_disk and len(on_disk) == 14
    for name, digest in listed.items():
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest, name
    assert sorted(shipped_names()) == ["aime24", "aime25", "gaia", "gaia_test", "gsm8k", "hard_search_1k",
                                       "hle_test", "math500", "simpleqa", "train_10k", "valid", "webwalker", "xbench"]


def test_nothing_the_repository_ships_points_outside_it() -> None:
    """No config, test, loader or doc in the checkout names the data's old place beside it (``../shared``)."""
    tracked = [p for d in ("aepo_core", "infra", "tasks", "flows", "tests", "configs", "bench")
               for p in (REPO / d).rglob("*") if p.suffix in (".py", ".yaml", ".md") and "results" not in p.parts]
    old_place = "/".join(("shared", "data"))  # spelt apart: this file would find itself
    outside = [str(p.relative_to(REPO)) for p in [*tracked, REPO / "README.md", REPO / "Makefile"]
               if old_place in p.read_text(encoding="utf-8")]
    assert outside == []


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_file_loads_repaired(name: str) -> None:
    path = SHIPPED[name]
    dataset = read_dataset(name)
    rows = load_dataset_rows(name, on_bad_row="skip")
    assert rows == dataset.rows and rows
    assert len(rows) + len({b.index for b in dataset.bad_rows}) == _raw_row_count(path)
    assert len({r.id for r in rows}) == len(rows)
    for row in rows:
        assert row.question.strip() and row.golds and all(g.strip() for g in row.golds)
        assert "\x08" not in row.question and not any("\x08" in g for g in row.golds)
        for message in row.metadata.get("prompt", []):
            assert "\x08" not in message["content"] and "\x0c" not in message["content"]
    if path.suffix == ".parquet":  # every verl prompt asks for \boxed{}: the repair must have restored it
        raw = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        had = [i for i, msgs in enumerate(raw) if any("\x08oxed" in m["content"] for m in msgs)]
        assert had
        by_index = {r.metadata["index"]: r for r in rows}
        for i in had:
            if i in by_index:
                assert any("\\boxed{" in m["content"] for m in by_index[i].metadata["prompt"])
        assert all(r.metadata["prompt"][-1]["role"] == "user" for r in rows)
    else:
        assert all(r.split == "test" for r in rows)


def test_shipped_blank_answer_is_reported_then_skipped() -> None:
    with pytest.raises(BadRowError) as err:
        load_dataset_rows("train_10k")
    assert err.value.bad_rows == [BadRow(TRAIN_10K_BLANK_ANSWER_ROW, "reward_model.ground_truth", "empty")]
    assert f"row {TRAIN_10K_BLANK_ANSWER_ROW}" in str(err.value)
    rows = load_dataset_rows("train_10k", on_bad_row="skip")
    assert f"train_10k:{TRAIN_10K_BLANK_ANSWER_ROW}" not in {r.id for r in rows}


def test_benchmark_fields() -> None:
    gaia = load_dataset_rows("gaia")  # `Question` key
    assert gaia[0].question.startswith("I’m researching species") and gaia[0].golds == ("34689",)
    assert "task_id" in gaia[0].metadata
    assert load_dataset_rows("GSM8K")[0].golds == ("18",)  # "#### 18" → 18, the worked solution kept
    assert "####" in load_dataset_rows("gsm8k")[0].metadata["solution"]
    assert all(isinstance(r.golds, tuple) and r.golds for r in load_dataset_rows("simpleqa"))  # list answers
    aime25 = load_dataset_rows("aime25")  # `problem` key, integer answers
    assert aime25[0].question.startswith("Find the sum") and aime25[0].golds == ("70",)


def test_shipped_search_cache_becomes_a_bm25_corpus(tmp_path: Path) -> None:
    recorded = json.loads((DATA_ROOT / "search_cache.json").read_text(encoding="utf-8"))
    docs = load_search_corpus(DATA_ROOT / "search_cache.json")
    assert len({d["id"] for d in docs}) == len(docs) and len({d["text"] for d in docs}) == len(docs)
    assert not any(d["text"].startswith("Page ") for d in docs)
    query, text = next(iter(recorded.items()))
    first_page = text.split("\n")[0].removeprefix("Page 1:").strip()
    assert first_page in {d["text"] for d in docs}
    tool = SearchTool(Bm25Backend(docs, tmp_path), SearchToolConfig(top_k=5))
    try:
        assert tool(query).ok and "No results" not in tool(query).text
    finally:
        tool.close()


# ----------------------------------------------------------------------------------------------- malformed rows


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


MALFORMED_JSONL = [
    json.dumps({"question": "Good one?", "answer": "yes"}),  # 0
    json.dumps({"answer": "no question"}),  # 1: missing question
    json.dumps({"question": "Wrong answer type?", "answer": {"text": "x"}}),  # 2: answer is an object
    json.dumps({"question": "Empty answer?", "answer": "  "}),  # 3: empty answer
    json.dumps({"Question": "Good two?", "answer": ["a", "b"]}),  # 4
    json.dumps({"question": 17, "answer": "x"}),  # 5: question of wrong type
    "{not json",  # 6
    json.dumps({"question": "Empty list?", "answer": []}),  # 7
    json.dumps({"problem": "Good three?", "answer": 3}),  # 8: numbers are fine
    json.dumps({"question": "Boolean?", "answer": True}),  # 9
    json.dumps(["not", "an", "object"]),  # 10
]
BAD_JSONL = {1: "question", 2: "answer", 3: "answer", 5: "question", 6: "row", 7: "answer", 9: "answer", 10: "row"}


def test_malformed_jsonl_rows_are_reported_by_index_and_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bench" / "test.jsonl", MALFORMED_JSONL)
    with pytest.raises(BadRowError) as err:
        load_jsonl_benchmark(path)
    assert {b.index: b.field for b in err.value.bad_rows} == BAD_JSONL
    reasons = {b.index: b.reason for b in err.value.bad_rows}
    assert reasons[1] == "missing" and reasons[2] == "wrong type dict" and reasons[3] == "empty"
    assert reasons[5] == "wrong type int" and reasons[6].startswith("invalid JSON")
    for index in BAD_JSONL:  # named by their line in an editor (1-based; this file has no blank lines)
        assert f"line {index + 1}:" in str(err.value)

    rows = load_jsonl_benchmark(path, on_bad_row="skip")
    assert [r.id for r in rows] == ["bench:0", "bench:4", "bench:8"]
    assert [r.golds for r in rows] == [("yes",), ("a", "b"), ("3",)]
    assert load_dataset_rows(str(path), on_bad_row="skip") == rows
    with pytest.raises(ValueError, match="on_bad_row"):
        load_jsonl_benchmark(path, on_bad_row="ignore")  # type: ignore[arg-type]


def test_jsonl_rows_are_numbered_by_editor_line_blank_lines_included(tmp_path: Path) -> None:
    """A user opens the file in an editor: the bad row's number is its line there, blank lines counted."""
    good = json.dumps({"question": "Good?", "answer": "yes"})
    path = _write_jsonl(tmp_path / "gaps.jsonl", [good, "", "   ", good, json.dumps({"answer": "no question"})])
    with pytest.raises(BadRowError) as err:
        load_jsonl_benchmark(path)
    assert [(b.line, b.field) for b in err.value.bad_rows] == [(5, "question")]
    assert "line 5: question: missing" in str(err.value) and str(path) in str(err.value)


def test_non_utf8_jsonl_names_file_line_and_byte_offset_and_skips_the_row(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    good = json.dumps({"question": "Good?", "answer": "yes"}).encode()
    bad = b'{"question": "caf\xe9?", "answer": "x"}'  # Latin-1 é
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + b"\n\n" + bad + b"\n" + good + b"\n")
    offset = len(good) + 2 + bad.index(b"\xe9")
    with pytest.raises(BadRowError) as err:
        load_jsonl_benchmark(path)
    message = str(err.value)
    assert str(path) in message and "line 3:" in message and f"byte offset {offset}" in message
    assert "UTF-8" in message
    with caplog.at_level("WARNING"):
        rows = load_jsonl_benchmark(path, on_bad_row="skip")
    assert [r.question for r in rows] == ["Good?", "Good?"]
    assert "skipped 1 invalid row(s)" in caplog.text and "line 3" in caplog.text



def _verl_record(question: str | None, truth: object, *, user: str = "user text", split: str = "train") -> dict:
    return {
        "data_source": "unit",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "ability": "qa",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": 0, "question": question, "split": split},
    }


def test_verl_parquet_repairs_prompts_and_reads_golds(tmp_path: Path) -> None:
    records = [
        _verl_record("What is \x08oxed 1?", "1"),  # 0
        _verl_record(None, '["Paris", "paris, France"]', user="Capital of France?"),  # 1: fall back to the user turn
        _verl_record("Interval?", "[1, 2]"),  # 2: a math interval, not a list of answers
        _verl_record("Blank truth?", " "),  # 3: bad
        _verl_record(None, None, user=""),  # 4: bad twice
        _verl_record("Fraction?", "\x0crac{1}{2}"),  # 5
    ]
    path = tmp_path / "unit.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    with pytest.raises(BadRowError) as err:
        load_verl_parquet(path)
    assert [(b.index, b.field) for b in err.value.bad_rows] == [
        (3, "reward_model.ground_truth"), (4, "prompt[user].content"), (4, "reward_model.ground_truth")]
    rows = load_verl_parquet(path, on_bad_row="skip")
    assert [r.metadata["index"] for r in rows] == [0, 1, 2, 5]
    assert rows[0].question == "What is \\boxed 1?"
    assert rows[0].metadata["prompt"][0]["content"] == "Put the answer in \\boxed{}, e.g. \\[ \\boxed{42} \\]."
    assert rows[1].question == "Capital of France?" and rows[1].golds == ("Paris", "paris, France")
    assert rows[2].golds == ("[1, 2]",) and rows[3].golds == ("\\frac{1}{2}",)
    assert all(r.family == "qa" and r.split == "train" and r.data_source == "unit" for r in rows)
    assert load_dataset_rows(str(path), on_bad_row="skip") == rows


def test_repair_text() -> None:
    assert repair_text("\x08oxed{1} and \x0crac{a}{b}; di\x0bfferent \x0cfinds") == \
        "\\boxed{1} and \\frac{a}{b}; different finds"
    assert repair_text("plain\ttext\n") == "plain\ttext\n"


# ------------------------------------------------------------------------------------------- HF datasets files


def test_hf_dataset_files(tmp_path: Path) -> None:
    flat = [{"question": "One?", "answer": "1"}, {"question": "Two?", "answer": None}, {"question": "Three?",
                                                                                         "answer": "3"}]
    Dataset.from_list(flat).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(BadRowError) as err:
        load_hf_dataset_files(tmp_path / "single")
    assert err.value.bad_rows == [BadRow(1, "answer", "missing")]
    rows = load_hf_dataset_files(tmp_path / "single", on_bad_row="skip")
    assert [r.golds for r in rows] == [("1",), ("3",)]
    assert load_dataset_rows(str(tmp_path / "single"), on_bad_row="skip") == rows

    verl = [_verl_record("Q\x08?", "A", split="train")]
    DatasetDict({"train": Dataset.from_list(flat[:1]), "test": Dataset.from_list(verl)}).save_to_disk(
        str(tmp_path / "dict"))
    both = load_hf_dataset_files(tmp_path / "dict")
    assert [(r.question, r.split) for r in both] == [("One?", "train"), ("Q\\b?", "train")]
    assert [r.question for r in load_hf_dataset_files(tmp_path / "dict", split="test")] == ["Q\\b?"]
    with pytest.raises(ValueError, match="no split"):
        load_hf_dataset_files(tmp_path / "dict", split="validation")

    arrow = next((tmp_path / "single").glob("*.arrow"))
    assert load_hf_dataset_files(arrow, on_bad_row="skip") == [
        QuestionRow(r.id.replace("single", arrow.stem), r.question, r.golds, arrow.stem, split="")
        for r in rows]


# ------------------------------------------------------------------------------------------------------ specs


def test_specs_resolve_names_paths_and_synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = SyntheticTask(seed=2, n_companies=12)
    assert load_dataset_rows("synthetic:test", synthetic=task) == task.questions("test")
    assert load_dataset_rows("synthetic", synthetic=task) == task.questions("train")
    assert load_dataset_rows("synthetic:valid", synthetic=task) == task.questions("validation")

    _write_jsonl(tmp_path / "eval" / "Mini" / "test.jsonl", [json.dumps({"question": "q?", "answer": "a"})])
    (tmp_path / "rl").mkdir()
    pq.write_table(pa.Table.from_pylist([_verl_record("v?", "w")]), tmp_path / "rl" / "tiny.parquet")
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    assert default_data_root() == tmp_path
    assert resolve_spec("mini") == tmp_path / "eval" / "Mini" / "test.jsonl"
    assert [r.question for r in load_dataset_rows("mini")] == ["q?"]
    assert [r.question for r in load_dataset_rows("tiny")] == ["v?"]
    assert [r.question for r in load_dataset_rows("rl/tiny.parquet")] == ["v?"]  # relative to the data root
    with pytest.raises(FileNotFoundError, match="mini"):
        load_dataset_rows("nonexistent")
    monkeypatch.delenv(DATA_ROOT_ENV)
    if SHIPPED:
        assert resolve_spec("gaia") == DATA_ROOT / "eval" / "gaia" / "test.jsonl"


def test_search_corpus_from_a_recorded_cache(tmp_path: Path) -> None:
    cache = {"q one": "Page 1: alpha beta\nPage 2: gamma delta", "q two": "No search results found.",
             "q three": "Page 1: gamma delta\nPage 2: epsilon"}
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(cache), encoding="utf-8")
    docs = load_search_corpus(path)
    assert docs == [{"id": "0:1", "title": "", "text": "alpha beta"}, {"id": "0:2", "title": "", "text": "gamma delta"},
                    {"id": "2:2", "title": "", "text": "epsilon"}]


# ------------------------------------------------------------------------------------------------------ keys


def test_dataset_keys_are_readable_legal_metric_names_and_never_merge() -> None:
    """`aepo eval -d /abs/file.jsonl` (or ./x, ../x): the key in metric names and result files is the file's name,
    legal for MLflow, and two datasets of one name in one evaluation get different keys."""
    from infra.tracking.client import MAX_KEY, metric_key

    assert dataset_key("/abs/dir/file.jsonl") == "file"
    assert dataset_key("../eval/gaia/test.jsonl") == "gaia"  # the shipped benchmark layout: the directory names it
    assert dataset_key("synthetic:test") == "synthetic_test" and dataset_key("math500") == "math500"
    specs = ["./x.jsonl", "../x.jsonl", "/data/x.parquet", "/other/y.jsonl"]
    keys = [dataset_key(s, among=specs) for s in specs]
    assert len(set(keys)) == len(keys) and all(k.startswith("x") for k in keys[:3]) and keys[3] == "y"
    assert dataset_key("./x.jsonl", among=specs) == keys[0]  # stable: the same spec, the same key
    long = "/" + "/".join(["d" * 60] * 8) + "/" + "q" * 300 + ".jsonl"
    for spec in ("/abs/dir/file.jsonl", "./we!rd name@1.jsonl", long):
        name = f"eval/{dataset_key(spec)}/pass_at_1"
        assert metric_key(name) == name and len(name) <= MAX_KEY
    assert dataset_key(long) != dataset_key(long.replace("q" * 300, "q" * 299 + "r"))  # cut, but not merged
