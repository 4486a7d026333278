"""prepare_data: dataset → validated rows, cached on the inputs and the source file's identity."""

from __future__ import annotations

import hashlib
import os

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from aepo_core.config import DataConfig
from infra.data.loaders import default_data_root, is_synthetic, load_dataset_rows, resolve_spec
from infra.data.rows import QuestionRow
from infra.data.synthetic import SyntheticTask
from tasks.retry import transient_only


def source_fingerprint(spec: str, data_root: str | None) -> str:
    """What makes a cached result stale: the file's path, size and mtime (the generator's config for synthetic)."""
    if is_synthetic(spec):
        return "synthetic"
    path = resolve_spec(spec, data_root or default_data_root())
    st = os.stat(path)
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


@task(name="prepare_data", task_run_name="prepare-data", cache_policy=INPUTS + TASK_SOURCE, persist_result=True,
      retries=1, retry_condition_fn=transient_only)
def prepare_data(spec: str, data: DataConfig, fingerprint: str) -> list[QuestionRow]:
    """Validated rows (bad rows fail or are skipped with a count, as ``data.on_bad_row`` says); the result is
    cached on the inputs, so a re-run (or a resume) reads a large training file once."""
    synthetic = SyntheticTask.from_config(data) if is_synthetic(spec) else None
    rows = load_dataset_rows(spec, data.on_bad_row, data_root=data.data_root, synthetic=synthetic)
    get_run_logger().info("prepared %d rows from %s (fingerprint %s)", len(rows), spec, fingerprint)
    return rows
