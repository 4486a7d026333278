"""Parquet trajectory store: the rollout trees of every step, on local disk or S3 (fsspec).

Layout under the store URI (a local path, ``file://…`` or ``s3://bucket/prefix``)::

    trajectories/run_id=<run>/step=<step>/part-00000.parquet   one row per leaf (a trajectory)
    nodes/run_id=<run>/step=<step>/part-00000.parquet          one row per tree node (a segment)

Hive partitioning, so plain ``pyarrow.dataset.dataset(root + "/trajectories", partitioning="hive")``,
pandas, polars or DuckDB (``read_parquet('…/trajectories/**/*.parquet', hive_partitioning=true)``) read it
without this package.  Each part file also carries ``run_id`` and ``step`` as columns (the same types hive
inference gives: string and int32), so a single file is self-describing.

Why these choices:

- Deterministic part names: re-writing a step (a resumed run repeating a step) replaces it, never duplicates.
- Atomic parts: locally the file is written under a hidden temporary name in the same directory, fsynced and
  renamed over the final name (:mod:`infra.atomic`); on S3 the part is serialized in memory and sent as one PUT
  (an object is either fully visible or absent).  Readers ignore names starting with ``.`` or ``_``, so a crash
  mid-write never shows a partial part.
- ``nodes`` is written before ``trajectories``: a step is complete when its trajectories part exists, which is
  what :meth:`TrajectoryStore.steps` lists.
- Scalar floats that are NaN (not measured) or absent (a step written without its scores) are stored as
  nulls, so SQL aggregates skip them; token-level arrays are stored as they are.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from aepo_core.config import StorageConfig
from aepo_core.rollout.tree import Leaf, Node, RolloutTree
from aepo_core.scoring import LeafScore, check_aligned
from infra.atomic import atomic_file, leftover_temps
from infra.fs import StorageError, open_fs
from infra.fs import storage_options as fs_options

log = logging.getLogger(__name__)

TableName = Literal["trajectories", "nodes"]
TABLES: tuple[TableName, ...] = ("trajectories", "nodes")
PART_NAME = "part-00000.parquet"
COMPRESSION = "zstd"

_STRING_LIST = pa.list_(pa.string())

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("leaf_id", pa.int64(), nullable=False),
        pa.field("sample_kind", pa.string(), nullable=False),
        pa.field("path", pa.list_(pa.int64()), nullable=False),
        pa.field("prompt_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("response_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("entropies", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float64()),
        pa.field("reward_reason", pa.string(), nullable=False),
        pa.field("advantage", pa.float64()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("num_tool_calls", pa.int32(), nullable=False),
        pa.field("tool_names", _STRING_LIST, nullable=False),
        pa.field("tool_errors", pa.int32(), nullable=False),
        pa.field("branch_steps", pa.int32(), nullable=False),
        pa.field("wall_ms", pa.float64(), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("global_budget", pa.int32(), nullable=False),
        pa.field("h_root", pa.float64()),
        pa.field("h_tool", pa.float64()),
        pa.field("weight_version", pa.string()),
    ],
    metadata={"aepo.table": "trajectories", "aepo.schema_version": "2"},
)
"""One row per leaf (trajectory) of a rollout tree.

- ``run_id`` (string): the run (also the hive partition ``run_id=…``).
- ``step`` (int32): the global RL step (also the hive partition ``step=…``).
- ``question_id`` (string): the question the tree answers.
- ``leaf_id`` (int64): the leaf's id within its tree.
- ``sample_kind`` (string): ``global`` / ``branch`` / ``fill`` — how the trajectory was sampled.
- ``path`` (list<int64>): node ids from the prompt (node 0) to the last segment; join with ``nodes.node_id``.
- ``prompt_tokens`` (list<int32>): the prompt's token ids (chat template applied).
- ``response_tokens`` (list<int32>): every token after the prompt, model and tool-result tokens alike.
- ``loss_mask`` (list<int8>): 1 on model tokens, 0 on tool-result tokens; aligned with ``response_tokens``.
- ``logprobs`` (list<float32>): sampling log-probabilities per response token (0 on tool tokens).
- ``entropies`` (list<float32>): token entropies per response token (0 on tool tokens).
- ``reward`` (float64, null until scored) and ``reward_reason`` (string, "" until scored).
- ``advantage`` (float64, null until computed): the trajectory-level advantage.
- ``status`` (string): ``answered`` / ``truncated`` / ``tool_limit`` / ``tool_error`` / ``engine_error``.
- ``num_tool_calls`` (int32), ``tool_names`` (list<string>, in call order), ``tool_errors`` (int32: calls not ok).
- ``branch_steps`` (int32): tool steps on this path at which a branch was created.
- ``wall_ms`` (float64): wall time spent generating this trajectory.
- ``response_text`` (string): the decoded response (model text and tool results).
- ``global_budget`` (int32), ``h_root`` / ``h_tool`` (float64, null if unmeasured): the tree's pre-monitoring
  figures (m, H_root, mean tool-step entropy), repeated on each of its leaves.
- ``weight_version`` (string, null when the engine does not track versions): the weights that sampled the
  trajectory's model segments, as the server reported them (the RL step of the last weight sync); segments that
  disagree are listed in path order, comma-separated ("3,4": the trajectory straddled a sync).  Added in schema
  version 2; null in older parts.
"""

NODE_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("node_id", pa.int64(), nullable=False),
        pa.field("parent_id", pa.int64()),
        pa.field("depth", pa.int32(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("token_start", pa.int32(), nullable=False),
        pa.field("token_end", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("segment_entropy", pa.float64()),
        pa.field("delta_entropy", pa.float64()),
        pa.field("entropy_is_estimate", pa.bool_(), nullable=False),
        pa.field("consecutive_branches", pa.int32(), nullable=False),
        pa.field("branched", pa.bool_(), nullable=False),
        pa.field("branch_reason", pa.string(), nullable=False),
        pa.field("branch_score", pa.float64()),
        pa.field("tool_name", pa.string()),
        pa.field("tool_argument", pa.string()),
        pa.field("tool_ok", pa.bool_()),
        pa.field("tool_error", pa.string()),
        pa.field("tool_latency_ms", pa.float64()),
        pa.field("tool_cache_hit", pa.bool_()),
        pa.field("tool_result_chars", pa.int32()),
        pa.field("text", pa.string(), nullable=False),
        pa.field("weight_version", pa.string()),
    ],
    metadata={"aepo.table": "nodes", "aepo.schema_version": "2"},
)
"""One row per node (segment) of a rollout tree.

- ``run_id`` (string), ``step`` (int32), ``question_id`` (string): as in ``trajectories``.
- ``node_id`` (int64): id within the tree (0 is the prompt); ``parent_id`` (int64, null for the prompt).
- ``depth`` (int32): 0 for the prompt, +1 per segment.
- ``kind`` (string): ``prompt`` / ``model`` / ``tool`` (a tool-result segment).
- ``num_tokens`` (int32); ``token_start`` / ``token_end`` (int32): the segment's token span in the transcript.
- ``finish_reason`` (string): why generation of a model segment stopped ("" otherwise).
- ``segment_entropy`` (float64, null if unmeasured): mean entropy of the first W tokens of a model segment.
- ``delta_entropy`` (float64, null if unmeasured): ΔH of the segment against the tree's H_root.
- ``entropy_is_estimate`` (bool): the entropies are a top-k estimate (remote engines).
- ``consecutive_branches`` (int32): l, consecutive branched steps before this one (the penalty's input).
- ``branched`` (bool): this step created a branch.
- ``branch_reason`` (string): ``branch`` / ``below_tau`` / ``penalized`` / ``budget_full`` for a decision,
  ``fork`` for a branch's first segment, "" otherwise.
- ``branch_score`` (float64, null without a decision): the score compared to τ.
- ``tool_name``, ``tool_argument``, ``tool_ok``, ``tool_error``, ``tool_latency_ms``, ``tool_cache_hit``,
  ``tool_result_chars``: the tool call whose result this segment is (nulls on other nodes).
- ``text`` (string): the segment's text.
- ``weight_version`` (string, null on prompt/tool nodes and for engines that do not track versions): the weights
  that sampled a model segment, as the server reported them (schema version 2).
"""

SCHEMAS: dict[TableName, pa.Schema] = {"trajectories": TRAJECTORY_SCHEMA, "nodes": NODE_SCHEMA}
PARTITION_SCHEMA = pa.schema([pa.field("run_id", pa.string()), pa.field("step", pa.int32())])

# Run ids become directory names and hive partition values: keep them to safe characters, and not all digits
# (hive type inference would read them back as integers, clashing with the string column).
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_INT32_MAX = 2**31 - 1


class StoreError(ValueError):
    """A bad input to the store (run id, step, trees) or an unreadable store; the message says which."""


def _null_nan(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def check_run_id(run_id: object) -> str:
    """Validate a run id: it becomes a directory name and a hive partition value."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise StoreError(
            f"run_id must be 1–128 characters of letters, digits, '.', '_' or '-' starting with a letter or digit; "
            f"got {run_id!r}"
        )
    if run_id.isdigit():
        raise StoreError(f"run_id {run_id!r} is all digits: hive readers would infer an integer partition")
    return run_id


def check_step(step: object) -> int:
    """Validate a step: a non-negative int that fits the int32 column."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _INT32_MAX:
        raise StoreError(f"step must be an int in [0, {_INT32_MAX}]; got {step!r}")
    return step


def trees_to_tables(run_id: str, step: int, trees: Sequence[RolloutTree],
                    scores: Sequence[Sequence[LeafScore]] | None = None) -> dict[TableName, pa.Table]:
    """Flatten rollout trees into the two tables (pure: no I/O), validating the trees on the way.

    ``scores[i][j]`` is the score of leaf ``j`` of ``trees[i]`` (``StepScores.leaves``); without scores the
    ``reward`` and ``advantage`` columns are null and ``reward_reason`` is empty.
    """
    check_run_id(run_id)
    check_step(step)
    if isinstance(trees, RolloutTree) or not isinstance(trees, Sequence):
        raise StoreError(f"trees must be a list of RolloutTree; got {type(trees).__name__}")
    traj: dict[str, list[Any]] = {f.name: [] for f in TRAJECTORY_SCHEMA}
    nodes: dict[str, list[Any]] = {f.name: [] for f in NODE_SCHEMA}
    for ti, tree in enumerate(trees):
        if not isinstance(tree, RolloutTree):
            raise StoreError(f"trees[{ti}] is a {type(tree).__name__}, not a RolloutTree")
        if not isinstance(tree.question_id, str):
            raise StoreError(f"trees[{ti}].question_id must be a string; got {tree.question_id!r}")
    if scores is not None:
        try:
            check_aligned(trees, scores)
        except ValueError as exc:
            raise StoreError(f"run {run_id} step {step}: {exc}") from exc
    for ti, tree in enumerate(trees):
        _add_nodes(nodes, run_id, step, tree)
        _add_leaves(traj, run_id, step, tree, None if scores is None else scores[ti])
    try:
        return {
            "trajectories": pa.Table.from_pydict(traj, schema=TRAJECTORY_SCHEMA),
            "nodes": pa.Table.from_pydict(nodes, schema=NODE_SCHEMA),
        }
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise StoreError(f"cannot convert the trees of run {run_id} step {step} to Parquet columns: {exc}") from exc


def _add_nodes(cols: dict[str, list[Any]], run_id: str, step: int, tree: RolloutTree) -> None:
    for i, n in enumerate(tree.nodes):
        if n.node_id != i:
            raise StoreError(f"question {tree.question_id}: nodes[{i}] has node_id {n.node_id} (must equal its index)")
        for k, v in node_row(run_id, step, tree, n).items():
            cols[k].append(v)


def node_row(run_id: str, step: int, tree: RolloutTree, n: Node) -> dict[str, Any]:
    """The ``nodes`` row of one segment, as Python values (NaN as None): the Parquet writer's and the MLflow
    traces' (:mod:`infra.traces`) one definition of what a segment records."""
    t = n.tool
    return {
        "run_id": run_id, "step": step, "question_id": tree.question_id, "node_id": n.node_id,
        "parent_id": n.parent_id, "depth": n.depth, "kind": n.kind, "num_tokens": len(n.token_ids),
        "token_start": n.token_start, "token_end": n.token_end, "finish_reason": n.finish_reason,
        "segment_entropy": _null_nan(n.segment_entropy), "delta_entropy": _null_nan(n.delta_entropy),
        "entropy_is_estimate": bool(n.entropy_is_estimate), "consecutive_branches": n.consecutive_branches,
        "branched": bool(n.branched), "branch_reason": n.branch_reason,
        "branch_score": _null_nan(n.branch_score),
        "tool_name": t.name if t else None, "tool_argument": t.argument if t else None,
        "tool_ok": bool(t.ok) if t else None, "tool_error": t.error if t else None,
        "tool_latency_ms": t.latency_s * 1000.0 if t else None, "tool_cache_hit": bool(t.cache_hit) if t else None,
        "tool_result_chars": t.result_chars if t else None, "text": n.text, "weight_version": n.weight_version,
    }


def _add_leaves(cols: dict[str, list[Any]], run_id: str, step: int, tree: RolloutTree,
                scores: Sequence[LeafScore] | None) -> None:
    n_nodes = len(tree.nodes)
    for j, leaf in enumerate(tree.leaves):
        where = f"question {tree.question_id} leaf {leaf.leaf_id}"
        bad = [i for i in leaf.node_ids if not isinstance(i, int) or not 0 <= i < n_nodes]
        if bad:
            raise StoreError(f"{where}: path refers to missing nodes {bad} (tree has {n_nodes})")
        row = leaf_row(run_id, step, tree, leaf, None if scores is None else scores[j])
        ids, mask, lps, ents = (row[k] for k in ("response_tokens", "loss_mask", "logprobs", "entropies"))
        if not len(ids) == len(mask) == len(lps) == len(ents):
            raise StoreError(
                f"{where}: token arrays disagree in length (ids {len(ids)}, mask {len(mask)}, "
                f"logprobs {len(lps)}, entropies {len(ents)}): a model node's logprobs/entropies are incomplete"
            )
        for k, v in row.items():
            cols[k].append(v)


def leaf_row(run_id: str, step: int, tree: RolloutTree, leaf: Leaf, score: LeafScore | None) -> dict[str, Any]:
    """The ``trajectories`` row of one leaf (None score: reward and advantage null, reason empty), as Python
    values (NaN as None): the Parquet writer's and the MLflow traces' one definition of what a trajectory records."""
    events = tree.tool_events(leaf)
    reward, reason, advantage = (score.reward, score.reason, score.advantage) if score else (None, "", None)
    return {
        "run_id": run_id, "step": step, "question_id": tree.question_id, "leaf_id": leaf.leaf_id,
        "sample_kind": leaf.sample_kind, "path": list(leaf.node_ids), "prompt_tokens": list(tree.prompt_ids),
        "response_tokens": tree.response_ids(leaf), "loss_mask": tree.loss_mask(leaf),
        "logprobs": tree.logprobs(leaf), "entropies": tree.entropies(leaf),
        "reward": _null_nan(reward), "reward_reason": reason,
        "advantage": _null_nan(advantage), "status": leaf.status, "num_tool_calls": len(events),
        "tool_names": [e.name for e in events], "tool_errors": sum(not e.ok for e in events),
        "branch_steps": leaf.branch_steps, "wall_ms": leaf.wall_s * 1000.0, "response_text": tree.text(leaf),
        "global_budget": tree.global_budget, "h_root": _null_nan(tree.h_root), "h_tool": _null_nan(tree.h_tool),
        "weight_version": _path_versions(tree, leaf),
    }


def _path_versions(tree: RolloutTree, leaf: Leaf) -> str | None:
    """The distinct weight versions of a trajectory's model segments, in path order (None: untracked)."""
    versions = [n.weight_version for n in tree.path(leaf) if n.kind == "model" and n.weight_version is not None]
    return ",".join(dict.fromkeys(versions)) or None


def _serialize(table: pa.Table, sink: Any) -> None:
    """Write one Parquet part (a seam the crash test patches)."""
    pq.write_table(table, sink, compression=COMPRESSION)


class TrajectoryStore:
    """Writes and reads the two trajectory tables under one root (local path or fsspec URL such as ``s3://``).

    ``storage_options`` go to fsspec (for S3, e.g. ``{"client_kwargs": {"endpoint_url": …}, "key": …}``).
    Safe to share between threads: every write goes to its own part file.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        if not str(uri):
            raise StoreError("store uri is empty")
        self.uri = str(uri)
        try:
            self.fs, self.root = open_fs(self.uri, storage_options)
        except StorageError as exc:
            raise StoreError(f"trajectory store: {exc}") from exc
        self.local = isinstance(self.fs, LocalFileSystem)

    @classmethod
    def from_config(cls, storage: StorageConfig, storage_options: Mapping[str, Any] | None = None) -> TrajectoryStore:
        """The store of ``cfg.storage``: ``trajectories_uri``, else ``<runs_dir>/trajectories``; an S3 endpoint
        (MinIO, moto, …) from ``s3_endpoint_url`` unless ``storage_options`` already name one."""
        uri = storage.trajectories_uri or str(Path(storage.runs_dir) / "trajectories")
        return cls(uri, fs_options(storage, uri, storage_options))

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.uri!r})"

    # ---- paths -------------------------------------------------------------------------------------------

    def table_root(self, table: TableName) -> str:
        """Root of one table's hive-partitioned directory tree."""
        if table not in SCHEMAS:
            raise StoreError(f"unknown table {table!r}; expected one of {TABLES}")
        return f"{self.root}/{table}"

    def part_path(self, table: TableName, run_id: str, step: int) -> str:
        """The (single, deterministic) part file of one step."""
        return f"{self.table_root(table)}/run_id={check_run_id(run_id)}/step={check_step(step)}/{PART_NAME}"

    # ---- writing -----------------------------------------------------------------------------------------

    def write_step(self, run_id: str, step: int, trees: Sequence[RolloutTree],
                   scores: Sequence[Sequence[LeafScore]] | None = None) -> list[str]:
        """Write (or replace) one step's trees and, when given, their leaves' scores (aligned with ``trees``);
        returns the written part paths (nodes, then trajectories)."""
        tables = trees_to_tables(run_id, step, trees, scores)
        written = []
        for name in ("nodes", "trajectories"):  # trajectories last: its part marks the step complete
            path = self.part_path(name, run_id, step)
            self._write_part(tables[name], path)
            written.append(path if self.local else self._url(path))
        log.info("stored run %s step %d: %d trees, %d trajectories, %d nodes", run_id, step, len(trees),
                 tables["trajectories"].num_rows, tables["nodes"].num_rows)
        return written

    def _url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _write_part(self, table: pa.Table, path: str) -> None:
        if self.local:
            self._write_local(table, Path(path))
        else:
            buf = io.BytesIO()
            _serialize(table, buf)
            self.fs.pipe(path, buf.getvalue())  # one PUT: the object appears whole or not at all
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    @staticmethod
    def _write_local(table: pa.Table, path: Path) -> None:
        for stale in leftover_temps(path):  # of a killed writer (one writer per step)
            stale.unlink(missing_ok=True)
        with atomic_file(path) as fh:
            _serialize(table, fh)

    # ---- reading -----------------------------------------------------------------------------------------

    def dataset(self, table: TableName) -> ds.Dataset:
        """The whole table as a hive-partitioned pyarrow Dataset with the documented schema."""
        root = self.table_root(table)
        if not self.local:
            self.fs.invalidate_cache(root)
        if not self.fs.exists(root):
            return ds.dataset(pa.Table.from_pylist([], schema=SCHEMAS[table]))
        try:
            return ds.dataset(
                root,
                schema=SCHEMAS[table],
                format="parquet",
                filesystem=None if self.local else self.fs,
                partitioning=ds.partitioning(PARTITION_SCHEMA, flavor="hive"),
                exclude_invalid_files=False,
            )
        except (OSError, pa.ArrowInvalid) as exc:
            raise StoreError(f"cannot read table {table!r} under {self.uri!r}: {exc}") from exc

    def read_table(
        self,
        table: TableName,
        run_id: str | None = None,
        step: int | Iterable[int] | None = None,
        question_id: str | Iterable[str] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Rows of ``table`` filtered by run, step(s) and question(s) (None: all), as a pyarrow Table."""
        flt = self._filter(run_id, step, question_id)
        if columns is not None:
            unknown = sorted(set(columns) - set(SCHEMAS[table].names))
            if unknown:
                raise StoreError(f"unknown columns {unknown} for table {table!r}")
        try:
            result = self.dataset(table).to_table(columns=list(columns) if columns is not None else None, filter=flt)
        except (OSError, pa.ArrowInvalid) as exc:
            raise StoreError(f"cannot read table {table!r} under {self.uri!r}: {exc}") from exc
        sort = [(k, "ascending") for k in ("run_id", "step", "question_id", "leaf_id" if table == "trajectories"
                                           else "node_id") if k in result.column_names]
        return result.sort_by(sort) if sort and result.num_rows else result

    def read_trajectories(self, run_id: str | None = None, step: int | Iterable[int] | None = None,
                          question_id: str | Iterable[str] | None = None,
                          columns: Sequence[str] | None = None) -> pd.DataFrame:
        """Trajectory rows (one per leaf) as a pandas DataFrame; list columns hold numpy arrays."""
        return self.read_table("trajectories", run_id, step, question_id, columns).to_pandas()

    def read_nodes(self, run_id: str | None = None, step: int | Iterable[int] | None = None,
                   question_id: str | Iterable[str] | None = None,
                   columns: Sequence[str] | None = None) -> pd.DataFrame:
        """Node rows (one per tree segment) as a pandas DataFrame."""
        return self.read_table("nodes", run_id, step, question_id, columns).to_pandas()

    @staticmethod
    def _filter(run_id: str | None, step: int | Iterable[int] | None,
                question_id: str | Iterable[str] | None) -> ds.Expression | None:
        parts = []
        if run_id is not None:
            parts.append(ds.field("run_id") == check_run_id(run_id))
        if step is not None:
            steps = [check_step(step)] if isinstance(step, int) else [check_step(s) for s in step]
            parts.append(ds.field("step").isin(steps))
        if question_id is not None:
            qids = [question_id] if isinstance(question_id, str) else list(question_id)
            if not all(isinstance(q, str) for q in qids):
                raise StoreError(f"question_id must be a string or strings; got {question_id!r}")
            parts.append(ds.field("question_id").isin(qids))
        if not parts:
            return None
        expr = parts[0]
        for p in parts[1:]:
            expr = expr & p
        return expr

    def run_ids(self) -> list[str]:
        """Runs that have at least one complete step."""
        return sorted({p.split("/run_id=", 1)[1].split("/", 1)[0] for p in self._complete_parts("*")})

    def steps(self, run_id: str) -> list[int]:
        """Complete steps of a run (those whose trajectories part exists), ascending."""
        check_run_id(run_id)
        return sorted(int(p.rsplit("/step=", 1)[1].split("/", 1)[0]) for p in self._complete_parts(run_id))

    def _complete_parts(self, run_glob: str) -> list[str]:
        root = self.table_root("trajectories")
        if not self.local:
            self.fs.invalidate_cache(root)
        return [p for p in self.fs.glob(f"{root}/run_id={run_glob}/step=*/{PART_NAME}")
                if p.rsplit("/step=", 1)[1].split("/", 1)[0].isdigit()]

    def delete_run(self, run_id: str) -> None:
        """Remove every part of a run (both tables)."""
        for table in TABLES:
            path = f"{self.table_root(table)}/run_id={check_run_id(run_id)}"
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        log.info("deleted run %s from %s", run_id, self.uri)

