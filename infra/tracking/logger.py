"""The narrow metric logger: what any run logger records — scalars at a step, params, text and files — so that a
file or stdout logger implements it as well as MLflow's :class:`~infra.tracking.run.Tracker` (the shape of
torchtune's ``MetricLoggerInterface``: ``log``, ``log_dict``, ``log_config``, ``close``).

The MLflow-specific parts stay beside it: the run's lifecycle, datasets, figures, traces and trajectory samples
(:class:`~infra.tracking.run.RunLogger`), its history and model (:class:`~infra.tracking.run.Tracker`), the registry
(:mod:`infra.tracking.registry`). :class:`JsonlLogger` is the file logger: a run's record in a folder, readable
without MLflow (``pandas.read_json(<dir>/metrics.jsonl, lines=True)``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from infra.atomic import atomic_file


@runtime_checkable
class MetricLogger(Protocol):
    """What a run logs, whatever records it."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> int:
        """Scalars at ``step`` (non-finite values and non-numbers are skipped); returns how many were logged."""
        ...

    def log_params(self, params: Mapping[str, object]) -> None:
        """Params (write-once: a param keeps its first value)."""
        ...

    def log_text(self, text: str, artifact_file: str) -> None:
        """``text`` as the file ``artifact_file`` of the run."""
        ...

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """A local file (or a directory's contents) as the run's files under ``artifact_path``."""
        ...


class JsonlLogger:
    """A run's record in ``out_dir``: ``metrics.jsonl`` (one ``{"step", "key", "value"}`` line a scalar, appended),
    ``params.json`` (rewritten whole, temp file + rename) and ``artifacts/``."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out_dir = Path(out_dir)
        self.artifacts = self.out_dir / "artifacts"
        self.artifacts.mkdir(parents=True, exist_ok=True)
        params = self.out_dir / "params.json"
        self._params: dict[str, str] = json.loads(params.read_text()) if params.is_file() else {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> int:
        lines = []
        for key, value in metrics.items():
            try:
                x = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(x):
                lines.append(json.dumps({"step": int(step), "key": key, "value": x}) + "\n")
        with (self.out_dir / "metrics.jsonl").open("a") as f:
            f.writelines(lines)
        return len(lines)

    def log_params(self, params: Mapping[str, object]) -> None:
        new = {str(k): str(v) for k, v in params.items() if str(k) not in self._params}
        if new:
            self._params.update(new)
            with atomic_file(self.out_dir / "params.json", "w") as f:
                f.write(json.dumps(self._params, indent=1, sort_keys=True))

    def log_text(self, text: str, artifact_file: str) -> None:
        with atomic_file(self.artifacts / artifact_file, "w") as f:
            f.write(text)

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        source = Path(local_path)
        where = self.artifacts / (artifact_path or "")
        where.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, where, dirs_exist_ok=True)
        else:
            shutil.copy2(source, where / source.name)
