"""Datasets: the row type, loaders for verl/ARPO Parquet, JSONL benchmarks and HF ``datasets`` files, the offline
search corpus, and the synthetic agentic task with its oracle policy."""

from infra.data.loaders import (
    BadRow,
    BadRowError,
    LoadedDataset,
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
from infra.data.rows import QuestionRow
from infra.data.synthetic import OracleError, SyntheticTask, expected_reward, oracle_transcript

__all__ = [
    "BadRow",
    "BadRowError",
    "LoadedDataset",
    "OracleError",
    "QuestionRow",
    "SyntheticTask",
    "default_data_root",
    "expected_reward",
    "load_dataset_rows",
    "load_hf_dataset_files",
    "load_jsonl_benchmark",
    "load_search_corpus",
    "load_verl_parquet",
    "oracle_transcript",
    "read_dataset",
    "repair_text",
    "resolve_spec",
    "shipped_names",
]
