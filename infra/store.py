"""Parquet trajectory store: the rollout trees of every step, on local disk or S3 (fsspec).

Layout under the store URI (a local path, ``file://…`` or ``s3://bucket/prefix``)::

    trajectories/<run_id>/step-000003.parquet   one row per leaf (a trajectory)
    nodes/<run_id>/step-000003.parquet          one row per tree node (a segment)

The default URI is the runs dir, so the tables are ``<runs>/trajectories/`` and ``<runs>/nodes/``: siblings, one
schema each, so that reading a table's directory with any reader gives that table's rows.  (The previous default
URI, ``<runs>/trajectories``, held both: ``pd.read_parquet("<runs>/trajectories")`` returned node and leaf rows
mixed under one schema, DuckDB's glob counted both, polars raised a schema error.  Stores in that layout are
still read, and the next write moves them: :meth:`TrajectoryStore.adopt_nested_layout`.)

Every part carries ``run_id`` and ``step`` as columns and the directories are not hive keys (no ``key=value``),
so the files alone define the columns and every reader sees the same ones, with the types written:
``pandas.read_parquet(root + "/trajectories")``, ``polars.read_parquet(root + "/trajectories/**/*.parquet")``,
``pyarrow.dataset.dataset(root + "/trajectories", partitioning="hive")`` and DuckDB's
``read_parquet('…/trajectories/**/*.parquet', hive_partitioning=true)``.  The previous layout had
``run_id=<run>/step=<step>/`` directories *and* those columns, which hive readers could not merge
(``Field run_id has incompatible types: string vs dictionary``) and polars' glob reader ignored.  To read one run
or one step, name its directory or file; the step is in the file name, so "the parts of run R after step S"
need only a listing.  Each field's meaning is in its Arrow field metadata (``description``, read back by
pyarrow, ``pq.read_schema``) and, for readers that only see file metadata (DuckDB ``parquet_kv_metadata``), as
JSON under the file's ``aepo.columns`` key.

Parts of the previous layout (``run_id=<run>/step=<step>/part-00000.parquet``, schema versions 1–2) are still read
by this class (``aepo trajectories``), their newer columns null; plain readers need the current layout.

Why these choices:

- Deterministic part names: re-writing a step (a resumed run repeating a step) replaces it, never duplicates.
- Atomic parts: locally the file is written under a hidden temporary name in the same directory, fsynced and
  renamed over the final name (:mod:`infra.atomic`); on S3 the part is serialized in memory and sent as one PUT
  (an object is either fully visible or absent).  Temporaries start with ``.`` and end in ``.tmp``, so neither
  hidden-file rules (pyarrow, pandas) nor ``*.parquet`` globs (polars, DuckDB) pick up a partial part.
- ``nodes`` is written before ``trajectories``: a step is complete when its trajectories part exists, which is
  what :meth:`TrajectoryStore.steps` lists.
- Scalar floats that are NaN (not measured) or absent (a step written without its scores) are stored as
  nulls, so SQL aggregates skip them; token-level arrays are stored as they are.
- A row's columns and values are :func:`aepo_core.rollout.rows.node_row` / :func:`~aepo_core.rollout.rows.leaf_row`,
  the one definition the MLflow traces and the MLflow table of a step's sample also use.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from aepo_core.config import StorageConfig
from aepo_core.rollout.rows import leaf_row, node_row, null_nan
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore, check_aligned
from infra.atomic import atomic_file, leftover_temps
from infra.data.rows import QuestionRow
from infra.fs import StorageError, forget_listings, open_fs
from infra.fs import storage_options as fs_options

log = logging.getLogger(__name__)

TableName = Literal["trajectories", "nodes"]
TABLES: tuple[TableName, ...] = ("trajectories", "nodes")
COMPRESSION = "zstd"
SCHEMA_VERSION = "4"

_STRING_LIST = pa.list_(pa.string())


def column(name: str, type_: pa.DataType, description: str, nullable: bool = True) -> pa.Field:
    """A schema field whose meaning travels with it (Arrow field metadata ``description``)."""
    return pa.field(name, type_, nullable=nullable, metadata={"description": description})


def table_schema(table: str, fields: list[pa.Field], version: str) -> pa.Schema:
    """A table schema of described fields (:func:`column`); its metadata names the table and its version
    and repeats the descriptions as JSON (``aepo.columns``) for readers that see only the file's key-value metadata
    (DuckDB ``parquet_kv_metadata``, ``pq.read_metadata``)."""
    columns = {f.name: f.metadata[b"description"].decode() for f in fields}
    return pa.schema(fields, metadata={"aepo.table": table, "aepo.schema_version": version,
                                       "aepo.columns": json.dumps(columns, ensure_ascii=False)})


def _schema(table: TableName, fields: list[pa.Field]) -> pa.Schema:
    return table_schema(table, fields, SCHEMA_VERSION)


_RUN_ID = column("run_id", pa.string(), "The run (the MLflow run id); also the part's directory name.", False)
_STEP = column("step", pa.int32(), "The global RL step; also in the part's file name (step-000003.parquet).", False)
_QUESTION_ID = column("question_id", pa.string(), "The question the tree answers.", False)

TRAJECTORY_SCHEMA = _schema("trajectories", [
    _RUN_ID, _STEP, _QUESTION_ID,
    column("dataset", pa.string(), "The question's dataset: its row's data_source (verl's data_source field, else "
           "the file or benchmark name). Null when written without the questions or before schema version 3."),
    column("question", pa.string(), "The question text as the dataset gives it (before the chat template). Null "
           "when written without the questions or before schema version 3."),
    column("golds", _STRING_LIST, "The gold answers the reward compares with. Null when written without the "
           "questions or before schema version 3."),
    column("family", pa.string(), "The question family of per-family tables (synthetic: single_hop / two_hop / "
           "compute; verl: ability). Null when written without the questions or before schema version 3."),
    column("leaf_id", pa.int64(), "The leaf's id within its tree.", False),
    column("sample_kind", pa.string(), "How the trajectory was sampled: global / branch / fill.", False),
    column("path", pa.list_(pa.int64()), "Node ids from the prompt (node 0) to the last segment; join with "
           "nodes.node_id (same run_id, step, question_id).", False),
    column("prompt_tokens", pa.list_(pa.int32()), "The prompt's token ids (chat template applied).", False),
    column("response_tokens", pa.list_(pa.int32()), "Every token after the prompt, model and tool-result tokens "
           "alike; nodes.token_start/token_end index into it.", False),
    column("loss_mask", pa.list_(pa.int8()), "1 on model tokens, 0 on tool-result tokens; aligned with "
           "response_tokens.", False),
    column("logprobs", pa.list_(pa.float32()), "Sampling log-probabilities per response token (0 on tool "
           "tokens).", False),
    column("entropies", pa.list_(pa.float32()), "Token entropies (nats) per response token (0 on tool tokens).",
           False),
    column("reward", pa.float64(), "The trajectory's reward; null until scored or when not measured."),
    column("reward_reason", pa.string(), "Why the reward is what it is (e.g. f1=0.5, no_answer); \"\" until "
           "scored.", False),
    column("advantage", pa.float64(), "The trajectory-level advantage; null until computed."),
    column("update_advantage", pa.float64(), "The advantage the step's policy update used for this trajectory (with "
           "DAPO dynamic sampling recomputed over the update's groups; `aepo replay` re-runs the update from it). "
           "Null when its group was not in the update (uninformative, or past the batch), and before schema "
           "version 4."),
    column("update_group", pa.int32(), "The position of the trajectory's group (its question) among the update's "
           "groups: the update's samples are these groups in this order, each group's leaves by leaf_id. Null when "
           "the group was not in the update, and before schema version 4."),
    column("status", pa.string(), "How the trajectory ended: answered / truncated / tool_limit / tool_error "
           "(engine_error only in stores written before issue 50: a rollout in which the engine failed is now "
           "never stored).", False),
    column("num_tool_calls", pa.int32(), "Tool calls on the path.", False),
    column("tool_names", _STRING_LIST, "The tools called, in call order.", False),
    column("tool_errors", pa.int32(), "Tool calls on the path that did not succeed.", False),
    column("branch_steps", pa.int32(), "Tool steps on this path at which a branch was created.", False),
    column("wall_ms", pa.float64(), "Wall time spent generating this trajectory (ms).", False),
    column("response_text", pa.string(), "The decoded response (model text and tool results).", False),
    column("global_budget", pa.int32(), "m, the tree's global sampling budget from pre-monitoring (repeated on "
           "each leaf).", False),
    column("h_root", pa.float64(), "H_root, the tree's initial-segment entropy (null if unmeasured)."),
    column("h_tool", pa.float64(), "The tree's mean tool-step entropy from pre-monitoring (null if unmeasured)."),
    column("weight_version", pa.string(), "The weights that sampled the trajectory's model segments: the updates "
           "behind them, as the server reported them (the RL step of the last weight sync) or as the in-process "
           "engine was handed them (under train.max_staleness the rollouts of step j come from update "
           "max(c, j-1-s)); several, comma-separated in path order, when the trajectory straddled a sync "
           "(\"3,4\"); null when the engine does not track versions (an HF checkpoint loaded by path), and for the "
           "in-process engine before issue 56."),
])
"""One row per leaf (trajectory) of a rollout tree; each field's meaning is its ``description`` metadata
(:func:`describe` lists them)."""

NODE_SCHEMA = _schema("nodes", [
    _RUN_ID, _STEP, _QUESTION_ID,
    column("node_id", pa.int64(), "Id within the tree (0 is the prompt).", False),
    column("parent_id", pa.int64(), "The parent node's id; null for the prompt."),
    column("depth", pa.int32(), "0 for the prompt, +1 per segment.", False),
    column("kind", pa.string(), "prompt / model / tool (a tool-result segment).", False),
    column("num_tokens", pa.int32(), "Tokens of the segment.", False),
    column("token_start", pa.int32(), "Start of the segment's token span [token_start, token_end): for model and "
           "tool nodes an index into response_tokens (and loss_mask, logprobs, entropies) of every trajectory "
           "whose path holds the node, i.e. counted from the first token after the prompt; for the prompt node 0, "
           "an index into prompt_tokens.", False),
    column("token_end", pa.int32(), "End (exclusive) of the segment's token span; relative as token_start.", False),
    column("finish_reason", pa.string(), "Why generation of a model segment stopped (\"\" otherwise).", False),
    column("segment_entropy", pa.float64(), "What the rules read of a model segment: the mean entropy (nats) of its "
           "first W tokens, or under rollout.entropy_scale official the sum of their top-10 entropy terms ÷ ln|V| "
           "(null if unmeasured)."),
    column("delta_entropy", pa.float64(), "ΔH: the segment's entropy against the tree's H_root (null if "
           "unmeasured)."),
    column("entropy_is_estimate", pa.bool_(), "The entropies are a top-k estimate (remote engines).", False),
    column("consecutive_branches", pa.int32(), "l, consecutive branched steps before this one (the penalty's "
           "input).", False),
    column("branched", pa.bool_(), "This step created a branch.", False),
    column("branch_reason", pa.string(), "The branch decision: branch / below_tau / penalized / budget_full; fork "
           "for a branch's first segment; probe for a step of a kept probe whose entropies set m (no decision); \"\" "
           "where no decision was taken.", False),
    column("branch_score", pa.float64(), "The score compared to τ (null without a decision)."),
    column("tool_name", pa.string(), "The tool whose result this segment is (null on other nodes)."),
    column("tool_argument", pa.string(), "The tool call's argument (null on other nodes)."),
    column("tool_ok", pa.bool_(), "The tool call succeeded (null on other nodes)."),
    column("tool_error", pa.string(), "The tool call's error (null when it succeeded and on other nodes)."),
    column("tool_latency_ms", pa.float64(), "The tool call's latency in ms (null on other nodes)."),
    column("tool_cache_hit", pa.bool_(), "The tool result came from the cache (null on other nodes)."),
    column("tool_result_chars", pa.int32(), "Characters of the tool's result (null on other nodes)."),
    column("text", pa.string(), "The segment's text.", False),
    column("weight_version", pa.string(), "The weights that sampled a model segment (the updates behind them), as "
           "the server reported them or the in-process engine was handed them; null on prompt and tool nodes, for "
           "engines that do not track versions, before schema version 2 and for the in-process engine before "
           "issue 56."),
])
"""One row per node (segment) of a rollout tree; each field's meaning is its ``description`` metadata."""

SCHEMAS: dict[TableName, pa.Schema] = {"trajectories": TRAJECTORY_SCHEMA, "nodes": NODE_SCHEMA}


def describe(table: TableName) -> dict[str, str]:
    """Column name → meaning, from the schema's field metadata."""
    return {f.name: f.metadata[b"description"].decode() for f in SCHEMAS[table]}


# Run ids become directory names: safe characters only ('=' excluded, which also keeps them apart from the
# ``run_id=…`` directories of the previous layout).
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_INT32_MAX = 2**31 - 1
# A part's path under its table root, in the current layout and in the previous (hive) one.
_PART_RE = re.compile(r"^(?P<run>[A-Za-z0-9][A-Za-z0-9._-]*)/step-(?P<step>[0-9]+)\.parquet$")
_LEGACY_PART_RE = re.compile(r"^run_id=(?P<run>[^/]+)/step=(?P<step>[0-9]+)/part-00000\.parquet$")
NESTED_ROOT = "trajectories"
"""The previous default root, ``<runs>/trajectories``, held both tables (``<runs>/trajectories/trajectories/`` and
``<runs>/trajectories/nodes/``): still read, and moved to the current layout by the next write."""


class StoreError(ValueError):
    """A bad input to the store (run id, step, trees) or an unreadable store; the message says which."""


@dataclass(frozen=True)
class StoredPart:
    """One part file: its run, step and path (fsspec path: no scheme on S3); ``legacy``: the previous layout."""

    run_id: str
    step: int
    path: str
    legacy: bool = False


def check_run_id(run_id: object) -> str:
    """Validate a run id: it becomes a directory name."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise StoreError(
            f"run_id must be 1–128 characters of letters, digits, '.', '_' or '-' starting with a letter or digit; "
            f"got {run_id!r}"
        )
    return run_id


def check_step(step: object) -> int:
    """Validate a step: a non-negative int that fits the int32 column."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _INT32_MAX:
        raise StoreError(f"step must be an int in [0, {_INT32_MAX}]; got {step!r}")
    return step


def trees_to_tables(run_id: str, step: int, trees: Sequence[RolloutTree],
                    scores: Sequence[Sequence[LeafScore]] | None = None,
                    questions: Mapping[str, QuestionRow] | None = None,
                    update: Sequence[Sequence[float] | None] | None = None) -> dict[TableName, pa.Table]:
    """Flatten rollout trees into the two tables (pure: no I/O), validating the trees on the way.

    ``scores[i][j]`` is the score of leaf ``j`` of ``trees[i]`` (``StepScores.leaves``); without scores the
    ``reward`` and ``advantage`` columns are null and ``reward_reason`` is empty.  ``questions`` (question id →
    row) fills ``dataset``, ``question``, ``golds`` and ``family``; every tree's question must be there.  Without
    it those columns are null.  ``update[i]`` holds the advantages the update used for ``trees[i]``'s leaves, None
    for a tree the update left out (:meth:`aepo_core.dynamic_sampling.FilledBatch.update_advantages`: the update's
    groups are the trees with advantages, in this order); without it ``update_advantage`` and ``update_group`` are null.
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
        if questions is not None and tree.question_id not in questions:
            raise StoreError(f"run {run_id} step {step}: trees[{ti}] answers question {tree.question_id!r}, "
                             f"which is not among the {len(questions)} questions given")
    if scores is not None:
        try:
            check_aligned(trees, scores)
        except ValueError as exc:
            raise StoreError(f"run {run_id} step {step}: {exc}") from exc
    if update is not None and (len(update) != len(trees) or any(
            u is not None and len(u) != len(t.leaves) for t, u in zip(trees, update, strict=False))):
        raise StoreError(f"run {run_id} step {step}: the update's advantages are not aligned with the trees' leaves")
    group = 0
    for ti, tree in enumerate(trees):
        _add_nodes(nodes, run_id, step, tree)
        used = None if update is None else update[ti]
        _add_leaves(traj, run_id, step, tree, None if scores is None else scores[ti],
                    None if questions is None else questions[tree.question_id], used,
                    None if used is None else group)
        group += used is not None
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


def _add_leaves(cols: dict[str, list[Any]], run_id: str, step: int, tree: RolloutTree,
                scores: Sequence[LeafScore] | None, question: QuestionRow | None,
                update: Sequence[float] | None, group: int | None) -> None:
    n_nodes = len(tree.nodes)
    for j, leaf in enumerate(tree.leaves):
        where = f"question {tree.question_id} leaf {leaf.leaf_id}"
        bad = [i for i in leaf.node_ids if not isinstance(i, int) or not 0 <= i < n_nodes]
        if bad:
            raise StoreError(f"{where}: path refers to missing nodes {bad} (tree has {n_nodes})")
        row = {**leaf_row(run_id, step, tree, leaf, None if scores is None else scores[j], question),
               "update_advantage": None if update is None else null_nan(update[j]), "update_group": group}
        ids, mask, lps, ents = (row[k] for k in ("response_tokens", "loss_mask", "logprobs", "entropies"))
        if not len(ids) == len(mask) == len(lps) == len(ents):
            raise StoreError(
                f"{where}: token arrays disagree in length (ids {len(ids)}, mask {len(mask)}, "
                f"logprobs {len(lps)}, entropies {len(ents)}): a model node's logprobs/entropies are incomplete"
            )
        for k, v in row.items():
            cols[k].append(v)


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
    def from_config(cls, storage: StorageConfig, storage_options: Mapping[str, Any] | None = None,
                    runs_dir: str | os.PathLike[str] | None = None) -> TrajectoryStore:
        """The store of ``cfg.storage``: ``trajectories_uri``, else the runs dir (its ``trajectories/`` and
        ``nodes/``: ``runs_dir`` where the run's differs from ``storage.runs_dir``, a flow's or a command's); an S3
        endpoint (MinIO, moto, …) from ``s3_endpoint_url`` unless ``storage_options`` already name one."""
        uri = storage.trajectories_uri or str(runs_dir if runs_dir is not None else storage.runs_dir)
        return cls(uri, fs_options(storage, uri, storage_options))

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.uri!r})"

    # ---- paths -------------------------------------------------------------------------------------------

    def table_root(self, table: TableName) -> str:
        """Root of one table: a directory per run, a file per step."""
        if table not in SCHEMAS:
            raise StoreError(f"unknown table {table!r}; expected one of {TABLES}")
        return f"{self.root}/{table}"

    def _table_roots(self, table: TableName) -> list[str]:
        """Where ``table``'s parts may be, oldest layout first: under the previous default root (local stores only:
        a remote root was always the user's, never nested), then the current one."""
        nested = [f"{self.root}/{NESTED_ROOT}/{table}"] if self.local else []
        return [*nested, self.table_root(table)]

    def table_uri(self, table: TableName) -> str:
        """Where a table's directory is, as a user would type it (``s3://…`` on S3)."""
        return self.table_root(table) if self.local else self._url(self.table_root(table))

    def part_path(self, table: TableName, run_id: str, step: int) -> str:
        """The (single, deterministic) part file of one step: ``<table>/<run_id>/step-000003.parquet``."""
        return f"{self.table_root(table)}/{check_run_id(run_id)}/step-{check_step(step):06d}.parquet"

    def parts(self, table: TableName, run_id: str | None = None) -> list[StoredPart]:
        """The part files of ``table`` (of one run, or all), by (run, step); where a step has a part in more than
        one layout (a run resumed across a layout change), the current one."""
        found: dict[tuple[str, int], StoredPart] = {}
        for root in self._table_roots(table):  # oldest first: the current part of a step, listed last, wins
            if not self.local:
                forget_listings(self.fs, root)
            # One recursive listing per prefix (on S3 a paginated LIST, where a glob per layout would list twice).
            prefixes = [root] if run_id is None else [f"{root}/{check_run_id(run_id)}", f"{root}/run_id={run_id}"]
            listed = [path[len(root) + 1:] for prefix in prefixes for path in self.fs.find(prefix)
                      if path.startswith(root + "/")]
            for is_legacy in (True, False):
                for rel in listed:
                    m = (_LEGACY_PART_RE if is_legacy else _PART_RE).match(rel)
                    if m is not None:
                        key = (m["run"], int(m["step"]))
                        found[key] = StoredPart(key[0], key[1], f"{root}/{rel}", is_legacy)
        return [found[k] for k in sorted(found)]

    def check_parts(self, run_id: str) -> None:
        """Raise :class:`StoreError` naming the first part of the run (either table) whose Parquet footer cannot be
        read: a file damaged after it was written (parts are written whole, by rename or a single PUT)."""
        for table in SCHEMAS:
            for part in self.parts(table, run_id):
                try:
                    pq.read_metadata(part.path, filesystem=None if self.local else self.fs)
                except (OSError, pa.ArrowInvalid) as exc:
                    where = part.path if self.local else self._url(part.path)
                    raise StoreError(f"{where} (step {part.step} of run {run_id}) is damaged: {exc}") from exc

    def adopt_nested_layout(self) -> bool:
        """Move the parts of the previous default layout (``<runs>/trajectories/{trajectories,nodes}/``, both tables
        under one directory that plain readers mixed) to the current one (``<runs>/{trajectories,nodes}/``); a part
        the current layout already has for that step stays where it is and the old one is dropped. Local stores
        only (a remote root was always given by the user, never nested); True when something moved."""
        if not self.local or not all(Path(self._table_roots(t)[0]).is_dir() for t in TABLES):
            return False
        for table in ("nodes", "trajectories"):  # nodes first: a step is complete when its trajectories part is
            source, target = Path(self._table_roots(table)[0]), Path(self.table_root(table))
            for part in sorted(p for p in source.rglob("*") if p.is_file()):
                dest = target / part.relative_to(source)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.exists():
                    part.unlink()
                else:
                    os.replace(part, dest)
            shutil.rmtree(source)
        log.info("moved the trajectory store under %s/%s to its current layout (%s/trajectories and %s/nodes)",
                 self.root, NESTED_ROOT, self.root, self.root)
        return True

    # ---- writing -----------------------------------------------------------------------------------------

    def write_step(self, run_id: str, step: int, trees: Sequence[RolloutTree],
                   scores: Sequence[Sequence[LeafScore]] | None = None,
                   questions: Mapping[str, QuestionRow] | None = None,
                   update: Sequence[Sequence[float] | None] | None = None) -> list[str]:
        """Write (or replace) one step's trees and, when given, their leaves' scores (aligned with ``trees``),
        their questions (question id → row) and the update's advantages (:func:`trees_to_tables`); returns the
        written part paths (nodes, then trajectories)."""
        tables = trees_to_tables(run_id, step, trees, scores, questions, update)
        self.adopt_nested_layout()
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

    def dataset(self, table: TableName, run_id: str | None = None,
                step: int | Iterable[int] | None = None) -> ds.Dataset:
        """The table (or one run's, or some steps' parts: chosen by path, no other file is opened) as a pyarrow
        Dataset with the documented schema; columns a part lacks (older schema versions) read as nulls."""
        steps = None if step is None else {check_step(step)} if isinstance(step, int) else {check_step(s) for s in step}
        paths = [p.path for p in self.parts(table, run_id) if steps is None or p.step in steps]
        if not paths:
            return ds.dataset(pa.Table.from_pylist([], schema=SCHEMAS[table]))
        try:
            return ds.dataset(paths, schema=SCHEMAS[table], format="parquet",
                              filesystem=None if self.local else self.fs)
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
        flt = self._question_filter(question_id)
        if columns is not None:
            unknown = sorted(set(columns) - set(SCHEMAS[table].names))
            if unknown:
                raise StoreError(f"unknown columns {unknown} for table {table!r}")
        try:
            result = self.dataset(table, run_id, step).to_table(
                columns=list(columns) if columns is not None else None, filter=flt)
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
    def _question_filter(question_id: str | Iterable[str] | None) -> ds.Expression | None:
        if question_id is None:
            return None
        qids = [question_id] if isinstance(question_id, str) else list(question_id)
        if not all(isinstance(q, str) for q in qids):
            raise StoreError(f"question_id must be a string or strings; got {question_id!r}")
        return ds.field("question_id").isin(qids)

    def run_ids(self) -> list[str]:
        """Runs that have at least one complete step."""
        return sorted({p.run_id for p in self.parts("trajectories")})

    def steps(self, run_id: str) -> list[int]:
        """Complete steps of a run (those whose trajectories part exists), ascending."""
        return [p.step for p in self.parts("trajectories", run_id)]

    def delete_steps_after(self, run_id: str, step: int) -> list[int]:
        """Remove a run's parts of the steps after ``step`` (both tables; trajectories first, so a crash midway
        leaves at worst an orphan nodes part, never a step that looks complete); returns the steps removed.

        A resume from the checkpoint of ``step`` repeats the later steps: their parts from before the kill would
        otherwise stay next to (or, should the resumed run stop earlier, instead of) the repeated ones."""
        check_run_id(run_id)
        removed = set()
        for table in ("trajectories", "nodes"):
            # Until none is left: a step with a part in both layouts lists only the current one the first time.
            while later := [p for p in self.parts(table, run_id) if p.step > step]:
                for part in later:
                    # a previous-layout part is the only file of its step=N/ directory
                    self.fs.rm(part.path.rsplit("/", 1)[0] if part.legacy else part.path, recursive=part.legacy)
                    removed.add(part.step)
        if removed:
            log.info("deleted run %s steps %s from %s (after step %d, which a resume repeats)", run_id,
                     sorted(removed), self.uri, step)
        return sorted(removed)

    def delete_run(self, run_id: str) -> None:
        """Remove every part of a run (both tables, both layouts)."""
        for table in TABLES:
            for root in self._table_roots(table):
                for path in (f"{root}/{check_run_id(run_id)}", f"{root}/run_id={run_id}"):
                    if self.fs.exists(path):
                        self.fs.rm(path, recursive=True)
        log.info("deleted run %s from %s", run_id, self.uri)
