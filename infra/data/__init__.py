"""Datasets: the row type, loaders for verl/ARPO Parquet, JSONL benchmarks and HF ``datasets`` files, the offline
search corpus, and the synthetic agentic task with its oracle policy."""
