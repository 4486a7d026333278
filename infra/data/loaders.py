"""Dataset loaders: verl/ARPO Parquet, JSONL benchmarks, local HF ``datasets`` files, the synthetic task, and the
offline search corpus from ARPO's recorded search results.

Why one module: every source is turned into :class:`~infra.data.rows.QuestionRow` through the same validation, so
a bad row (missing or empty question/answer, wrong type) is reported by index and field — all of them at once —
and the configured policy decides: ``fail`` raises :class:`~infra.data.rows.BadRowError`, ``skip`` drops them and
logs the count.

Known defects of the shipped ARPO data handled here:

- prompts were written with ``"\\boxed"`` in a non-raw Python string, so a backspace (``\\x08``) stands where
  ``\\b`` should be; likewise a form feed before ``rac`` where ``\\frac`` was meant.  Both are repaired, and stray
  form-feed / vertical-tab characters from PDF ligatures (``di\\x0bfferent``) are removed.
- ``train_10k.parquet`` row 5274 has a blank ground truth: it is a bad row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from aepo_core.config import is_synthetic
from infra.data.rows import BadRow, BadRowError, QuestionRow
from infra.data.synthetic import DATA_SOURCE as SYNTHETIC_SOURCE
from infra.data.synthetic import SyntheticTask
from infra.encoding import not_utf8
from infra.tools.search import split_pages

logger = logging.getLogger(__name__)

OnBadRow = Literal["fail", "skip"]
DATA_ROOT_ENV = "AEPO_DATA_ROOT"
# The ARPO/AEPO data shipped in this package (infra/data/arpo: its README says what and whence), so a clone anywhere
# and an installed wheel both resolve the names.
DEFAULT_DATA_ROOT = Path(__file__).resolve().parent / "arpo"
SYNTHETIC_PREFIX = "synthetic"
EVAL_DIR = "eval"
RL_DIR = "rl"
BENCHMARK_FILE = "test.jsonl"

QUESTION_KEYS: tuple[str, ...] = ("question", "Question", "problem", "query")
ANSWER_KEYS: tuple[str, ...] = ("answer", "Answer", "answers", "golden_answers", "ground_truth")
ID_KEYS: tuple[str, ...] = ("id", "task_id", "idx")
# Control characters that only ever appear as damage: (mangled text, repair).  Order matters (longest first).
TEXT_REPAIRS: tuple[tuple[str, str], ...] = (
    ("\x08", "\\b"),  # "\boxed" written in a non-raw string
    ("\x0crac", "\\frac"),  # "\frac" likewise
    ("\x0c", ""),  # PDF-ligature debris ("\x0cfinds")
    ("\x0b", ""),  # likewise ("di\x0bfferent")
)
# GSM8K-style answers: a worked solution whose last line is "#### <final answer>".
_FINAL_ANSWER_RE = re.compile(r"^####\s*(.+?)\s*$", re.MULTILINE)


@dataclass
class LoadedDataset:
    """Valid rows plus the rows that failed validation, before the bad-row policy is applied."""

    source: str
    rows: list[QuestionRow]
    bad_rows: list[BadRow] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------------------
# Field helpers
# --------------------------------------------------------------------------------------------------------------


def repair_text(text: str) -> str:
    """Undo the escape damage of the ARPO data (see the module docstring); other text is returned unchanged."""
    for bad, good in TEXT_REPAIRS:
        if bad in text:
            text = text.replace(bad, good)
    return text


def _repair_any(value: Any) -> Any:
    """:func:`repair_text` applied to every string inside nested lists/dicts (prompts, metadata)."""
    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, list):
        return [_repair_any(v) for v in value]
    if isinstance(value, dict):
        return {k: _repair_any(v) for k, v in value.items()}
    return value


def _gold_strings(value: Any, field_name: str, index: int) -> tuple[tuple[str, ...], BadRow | None]:
    """Gold answers from a string, a number, a list of those, or a JSON-encoded list of strings.

    A string that parses as a JSON list counts as several golds only when every element is a string: math
    answers like ``"[1, 2]"`` are intervals, not lists of answers.
    """
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            try:
                decoded = json.loads(stripped)
            except ValueError:
                decoded = None
            if isinstance(decoded, list) and decoded and all(isinstance(v, str) for v in decoded):
                value = decoded
    if isinstance(value, bool) or value is None:
        reason = "missing" if value is None else f"wrong type {type(value).__name__}"
        return (), BadRow(index, field_name, reason)
    items = value if isinstance(value, (list, tuple)) else [value]
    golds: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            return (), BadRow(index, field_name, f"wrong type {type(item).__name__}")
        text = repair_text(str(item)).strip()
        if text:
            golds.append(text)
    if not golds:
        return (), BadRow(index, field_name, "empty")
    return tuple(golds), None


def _question_string(value: Any, field_name: str, index: int) -> tuple[str, BadRow | None]:
    if value is None:
        return "", BadRow(index, field_name, "missing")
    if not isinstance(value, str):
        return "", BadRow(index, field_name, f"wrong type {type(value).__name__}")
    text = repair_text(value).strip()
    if not text:
        return "", BadRow(index, field_name, "empty")
    return text, None


def _first_key(record: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    return next((k for k in keys if k in record and record[k] is not None), None)


def _final_answer(text: str) -> str:
    """GSM8K convention: the answer is what follows the last ``####`` line; other answers pass unchanged."""
    matches = _FINAL_ANSWER_RE.findall(text)
    return matches[-1] if matches else text


# --------------------------------------------------------------------------------------------------------------
# Record → row
# --------------------------------------------------------------------------------------------------------------


def _verl_row(record: Mapping[str, Any], index: int, stem: str) -> QuestionRow | list[BadRow]:
    """A verl/ARPO record: question from ``extra_info.question`` (else the last user message), golds from
    ``reward_model.ground_truth``; the repaired prompt messages are kept in metadata."""
    bad: list[BadRow] = []
    extra = record.get("extra_info")
    extra = extra if isinstance(extra, Mapping) else {}
    prompt = record.get("prompt")
    messages = list(prompt) if isinstance(prompt, (list, tuple)) else []
    raw_question = extra.get("question")
    question_field = "extra_info.question"
    if not (isinstance(raw_question, str) and raw_question.strip()):
        users = [m for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            raw_question, question_field = users[-1].get("content"), "prompt[user].content"
    question, problem = _question_string(raw_question, question_field, index)
    if problem:
        bad.append(problem)
    reward_model = record.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    golds, problem = _gold_strings(truth, "reward_model.ground_truth", index)
    if problem:
        bad.append(problem)
    if bad:
        return bad
    source = record.get("data_source")
    metadata: dict[str, Any] = {
        "index": index,
        "source_index": extra.get("index"),
        "prompt": _repair_any([dict(m) for m in messages if isinstance(m, Mapping)]),
    }
    if isinstance(reward_model, Mapping) and reward_model.get("style") is not None:
        metadata["reward_style"] = reward_model["style"]
    ability = record.get("ability")
    return QuestionRow(
        id=f"{stem}:{index}",
        question=question,
        golds=golds,
        data_source=str(source) if source else stem,
        family=str(ability) if ability else "",
        split=str(extra.get("split") or ""),
        metadata=metadata,
    )


def _flat_row(record: Mapping[str, Any], index: int, name: str, split: str) -> QuestionRow | list[BadRow]:
    """A flat record: question under ``question``/``Question``/``problem``, answer(s) under ``answer``/…"""
    bad: list[BadRow] = []
    q_key = _first_key(record, QUESTION_KEYS)
    question, problem = _question_string(record.get(q_key) if q_key else None, q_key or "question", index)
    if problem:
        bad.append(problem)
    a_key = _first_key(record, ANSWER_KEYS)
    answer = record.get(a_key) if a_key else None
    solution = None
    if isinstance(answer, str) and _FINAL_ANSWER_RE.search(answer):
        solution, answer = answer, _final_answer(answer)
    golds, problem = _gold_strings(answer, a_key or "answer", index)
    if problem:
        bad.append(problem)
    if bad:
        return bad
    id_key = _first_key(record, ID_KEYS)
    used = {q_key, a_key, id_key}
    metadata: dict[str, Any] = {"index": index, **{k: v for k, v in record.items() if k not in used}}
    if id_key:
        metadata["source_id"] = record[id_key]
    if solution is not None:
        metadata["solution"] = solution
    return QuestionRow(
        id=f"{name}:{index}",
        question=question,
        golds=golds,
        data_source=str(record.get("data_source") or name),
        family=str(record.get("ability") or ""),
        split=str(record.get("split") or split),
        metadata=metadata,
    )


def _is_verl(record: Mapping[str, Any]) -> bool:
    return "reward_model" in record and "prompt" in record


def _convert(
    records: Iterable[Any], to_row: Callable[[Mapping[str, Any], int], QuestionRow | list[BadRow]], source: str,
    lines: Sequence[int] | None = None,
) -> LoadedDataset:
    """Rows and bad rows of ``records``; ``lines`` (line-based files): each record's line, put on its bad rows."""
    rows: list[QuestionRow] = []
    bad: list[BadRow] = []
    for index, record in enumerate(records):
        line = lines[index] if lines is not None else None
        if isinstance(record, BadRow):  # the reader already found this row unusable (e.g. invalid JSON)
            bad.append(record)
            continue
        if not isinstance(record, Mapping):
            bad.append(BadRow(index, "row", f"wrong type {type(record).__name__} (expected an object)", line))
            continue
        result = to_row(record, index)
        if isinstance(result, QuestionRow):
            rows.append(result)
        else:
            bad.extend(dataclasses.replace(b, line=line) for b in result)
    return LoadedDataset(source, rows, bad)


def _auto_row(name: str, split: str) -> Callable[[Mapping[str, Any], int], QuestionRow | list[BadRow]]:
    """Per-record schema detection: a table may be verl-shaped or flat."""

    def to_row(record: Mapping[str, Any], index: int) -> QuestionRow | list[BadRow]:
        return _verl_row(record, index, name) if _is_verl(record) else _flat_row(record, index, name, split)

    return to_row


def apply_bad_row_policy(dataset: LoadedDataset, on_bad_row: OnBadRow) -> list[QuestionRow]:
    """``fail``: raise :class:`BadRowError` listing every bad row; ``skip``: drop them and log how many."""
    if on_bad_row not in ("fail", "skip"):
        raise ValueError(f"on_bad_row must be 'fail' or 'skip', got {on_bad_row!r}")
    if dataset.bad_rows:
        if on_bad_row == "fail":
            raise BadRowError(dataset.source, dataset.bad_rows)
        places = sorted({(b.index, b.where) for b in dataset.bad_rows})
        logger.warning("%s: skipped %d invalid row(s) (%s%s)", dataset.source, len(places),
                       ", ".join(where for _, where in places[:10]), " …" if len(places) > 10 else "")
    logger.info("%s: %d rows", dataset.source, len(dataset.rows))
    return dataset.rows


# --------------------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------------------


def read_verl_parquet(path: str | os.PathLike[str]) -> LoadedDataset:
    """A verl/ARPO Parquet (see :func:`load_verl_parquet`), without applying the bad-row policy."""
    p = Path(path)
    records = pq.read_table(p).to_pylist()
    return _convert(records, _auto_row(p.stem, ""), str(p))


def load_verl_parquet(path: str | os.PathLike[str], on_bad_row: OnBadRow = "fail") -> list[QuestionRow]:
    """Rows of a verl/ARPO Parquet (columns ``data_source``, ``prompt``, ``ability``, ``reward_model``,
    ``extra_info``), with the prompt's escape damage repaired."""
    return apply_bad_row_policy(read_verl_parquet(path), on_bad_row)


def _benchmark_name(path: Path) -> str:
    """``eval/gaia/test.jsonl`` → ``gaia``; any other file → its stem."""
    return path.parent.name if path.name == BENCHMARK_FILE else path.stem


def read_jsonl_benchmark(path: str | os.PathLike[str]) -> LoadedDataset:
    """A JSONL benchmark (see :func:`load_jsonl_benchmark`); an unparsable line is a bad row."""
    p = Path(path)
    records, lines = _jsonl_records(p.read_bytes())
    return _convert(records, _auto_row(_benchmark_name(p), "test"), str(p), lines)


def _jsonl_records(data: bytes) -> tuple[list[Any], list[int]]:
    """One record per non-blank line, and each one's line number as an editor shows it (1-based, blank lines
    counted). A line that is not UTF-8 or not JSON becomes a :class:`BadRow` saying so (with the byte offset of
    the bad byte), so the bad-row policy decides about it like about any other row."""
    records: list[Any] = []
    lines: list[int] = []
    offset = 0
    for number, raw in enumerate(data.splitlines(keepends=True), start=1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        index = len(records)
        lines.append(number)
        try:
            records.append(json.loads(raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            records.append(BadRow(index, "row", not_utf8(exc, start), number))
        except ValueError as exc:
            records.append(BadRow(index, "row", f"invalid JSON: {exc}", number))
    return records, lines


def load_jsonl_benchmark(path: str | os.PathLike[str], on_bad_row: OnBadRow = "fail") -> list[QuestionRow]:
    """Rows of a JSONL benchmark: the question under ``question``/``Question``/``problem``, the answer under
    ``answer`` (a string, a number, a list or a JSON-encoded list); GSM8K's ``#### x`` answers become ``x``.
    Other keys (level, solution, ids) go to metadata."""
    return apply_bad_row_policy(read_jsonl_benchmark(path), on_bad_row)


def read_hf_dataset_files(path: str | os.PathLike[str], split: str | None = None) -> LoadedDataset:
    """Files written by HF ``datasets`` (see :func:`load_hf_dataset_files`)."""
    # Imported here: `datasets` is heavy and only this reader needs it.
    from datasets import Dataset, DatasetDict, load_from_disk

    p = Path(path)
    if p.is_dir():
        loaded = load_from_disk(str(p))
    elif p.suffix == ".arrow":
        loaded = Dataset.from_file(str(p))
    elif p.suffix == ".parquet":
        return _table_dataset(pq.read_table(p), p.stem, split or "", str(p))
    elif p.suffix in (".jsonl", ".json"):
        return read_jsonl_benchmark(p)
    else:
        raise ValueError(f"{p}: not a datasets directory (save_to_disk), .arrow, .parquet or .jsonl file")
    if isinstance(loaded, DatasetDict):
        names = [split] if split is not None else list(loaded)
        missing = [n for n in names if n not in loaded]
        if missing:
            raise ValueError(f"{p}: no split {missing}; it has {list(loaded)}")
        rows: list[QuestionRow] = []
        bad: list[BadRow] = []
        for name in names:  # indices count within each split; the field names the split
            part = _table_dataset(loaded[name].data.table, f"{p.name}/{name}", name, f"{p}[{name}]")
            rows.extend(part.rows)
            bad.extend(BadRow(b.index, f"{name}.{b.field}", b.reason) for b in part.bad_rows)
        return LoadedDataset(str(p), rows, bad)
    return _table_dataset(loaded.data.table, p.stem if p.is_file() else p.name, split or "", str(p))


def _table_dataset(table: pa.Table, name: str, split: str, source: str) -> LoadedDataset:
    return _convert(table.to_pylist(), _auto_row(name, split), source)


def load_hf_dataset_files(
    path: str | os.PathLike[str], on_bad_row: OnBadRow = "fail", split: str | None = None
) -> list[QuestionRow]:
    """Rows of a local HF ``datasets`` save: a ``save_to_disk`` directory (Dataset or DatasetDict — all splits,
    or only ``split``), a single ``.arrow`` file, or Parquet/JSONL exported by ``datasets``.  Records may be
    verl-shaped or flat question/answer; no network access and no cache writes."""
    return apply_bad_row_policy(read_hf_dataset_files(path, split), on_bad_row)


# --------------------------------------------------------------------------------------------------------------
# Specs: "synthetic:<split>", shipped names, or paths
# --------------------------------------------------------------------------------------------------------------


def default_data_root() -> Path:
    """``$AEPO_DATA_ROOT`` if set, else the data shipped in this package (``infra/data/arpo``)."""
    env = os.environ.get(DATA_ROOT_ENV)
    return Path(env) if env else DEFAULT_DATA_ROOT


def shipped_names(data_root: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Shorthand names of the shipped datasets → files: eval benchmarks by directory name (case-insensitive:
    ``gaia``, ``simpleqa``…) and RL Parquets by stem (``hard_search_1k``, ``valid``…)."""
    root = Path(data_root) if data_root is not None else default_data_root()
    names: dict[str, Path] = {}
    if (root / RL_DIR).is_dir():
        for f in sorted((root / RL_DIR).glob("*.parquet")):
            names[f.stem.lower()] = f
    if (root / EVAL_DIR).is_dir():
        for d in sorted((root / EVAL_DIR).iterdir()):
            if (d / BENCHMARK_FILE).is_file():
                names[d.name.lower()] = d / BENCHMARK_FILE
    return names


def resolve_spec(spec: str, data_root: str | os.PathLike[str] | None = None) -> Path:
    """The file or directory a non-synthetic spec names: an existing path, a path under the data root, or a
    shorthand name (see :func:`shipped_names`)."""
    root = Path(data_root) if data_root is not None else default_data_root()
    direct = Path(spec).expanduser()
    if direct.exists():
        return direct
    if not direct.is_absolute() and (root / direct).exists():
        return root / direct
    names = shipped_names(root)
    if spec.lower() in names:
        return names[spec.lower()]
    raise FileNotFoundError(
        f"dataset {spec!r} is neither a path nor a shipped name under {root} (known: {sorted(names) or 'none'}; "
        f"set {DATA_ROOT_ENV} or data.data_root to point elsewhere)"
    )


_UNSAFE_KEY = re.compile(r"[^A-Za-z0-9._-]+")
# Longest readable part of a key: ``eval/<key>/<summary name>`` must stay within MLflow's 250-character limit on
# metric names, which would otherwise cut two long names to one.
MAX_KEY_NAME = 64


def dataset_key(spec: str, among: Sequence[str] = ()) -> str:
    """The one name of a dataset wherever results name it: metric keys (``eval/<key>/pass_at_1``), result files
    (``<key>.parquet``) and tables.

    Readable: ``synthetic:test`` → ``synthetic_test``, a shipped name stays itself, a path gives its file's stem (a
    benchmark's ``<name>/test.jsonl``: the directory name), in characters MLflow and file systems accept.  Never
    merged: a name cut to :data:`MAX_KEY_NAME`, or shared with another spec of ``among`` (the datasets evaluated
    together, e.g. ``./x.jsonl`` and ``../x.jsonl``), gets a short hash of the spec appended.
    """
    key = _readable_key(spec)
    if len(key) > MAX_KEY_NAME or any(other != spec and _readable_key(other) == key for other in among):
        key = f"{key[:MAX_KEY_NAME]}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"
    return key


def _readable_key(spec: str) -> str:
    name = spec if is_synthetic(spec) else _benchmark_name(Path(spec))
    return _UNSAFE_KEY.sub("_", name).strip("._") or "dataset"


def read_dataset(
    spec: str,
    *,
    data_root: str | os.PathLike[str] | None = None,
    synthetic: SyntheticTask | None = None,
) -> LoadedDataset:
    """Rows and bad rows of ``spec`` (see :func:`load_dataset_rows`), before the bad-row policy."""
    if is_synthetic(spec):
        split = spec.partition(":")[2] or "train"
        task = synthetic if synthetic is not None else SyntheticTask()
        return LoadedDataset(f"{SYNTHETIC_SOURCE}:{split}", task.questions(split))
    path = resolve_spec(spec, data_root)
    if path.is_dir() or path.suffix == ".arrow":
        return read_hf_dataset_files(path)
    if path.suffix == ".parquet":
        return read_verl_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return read_jsonl_benchmark(path)
    raise ValueError(f"{path}: unsupported dataset file type {path.suffix!r} (parquet, jsonl, arrow or a directory)")


def load_dataset_rows(
    spec: str,
    on_bad_row: OnBadRow = "fail",
    *,
    data_root: str | os.PathLike[str] | None = None,
    synthetic: SyntheticTask | None = None,
) -> list[QuestionRow]:
    """Rows of any supported dataset.

    ``spec``: ``synthetic`` / ``synthetic:<split>`` (train, validation, test; ``synthetic`` alone is train) from
    ``synthetic`` (default: ``SyntheticTask()``); a Parquet path (verl schema, or flat); a JSONL path; a HF
    ``datasets`` directory or ``.arrow`` file; or a shipped name such as ``gaia``, ``math500``, ``hard_search_1k``
    resolved under ``data_root`` (default :func:`default_data_root`).
    """
    return apply_bad_row_policy(read_dataset(spec, data_root=data_root, synthetic=synthetic), on_bad_row)


# --------------------------------------------------------------------------------------------------------------
# Offline search corpus
# --------------------------------------------------------------------------------------------------------------


def load_search_corpus(search_cache_json: str | os.PathLike[str]) -> list[dict[str, str]]:
    """BM25 documents from ARPO's ``search_cache.json`` (``{query: "Page 1: …\\nPage 2: …"}``): one document per
    distinct page snippet (ids ``<query index>:<page>``, as the replay backend numbers them); recorded "no
    results" entries give none."""
    path = Path(search_cache_json)
    recorded = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(recorded, dict):
        raise ValueError(f"{path}: expected a JSON object {{query: 'Page 1: …'}}, got {type(recorded).__name__}")
    docs: list[dict[str, str]] = []
    seen: set[str] = set()
    for i, (query, text) in enumerate(recorded.items()):
        if not isinstance(text, str):
            logger.warning("%s: entry %d (%r) is not a string; skipped", path, i, query)
            continue
        for j, page in enumerate(split_pages(text)):
            if page not in seen:
                seen.add(page)
                docs.append({"id": f"{i}:{j + 1}", "title": "", "text": page})
    logger.info("%s: %d search-corpus documents from %d recorded queries", path, len(docs), len(recorded))
    return docs
