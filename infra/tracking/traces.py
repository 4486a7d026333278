"""Rollout trees as MLflow traces: one trace per question's tree, whose span tree *is* the rollout tree.

A trace is built after the fact from what the rollout recorded, so the MLflow UI's trace view can browse tool
calls, search queries and Python results of a step's (or an evaluation's) group of samples::

    q17 · step 3                                     AGENT  the question, its gold answers, the stage and step
      ├─ generate                                    LLM    a model segment: its ``nodes`` row (entropy, ΔH …)
      │    └─ search                                 TOOL   a tool call: its ``nodes`` row (argument, latency …)
      │         ├─ generate                          LLM    the global path goes on …
      │         │    └─ leaf 0 · global · correct · r=1.00   CHAIN  a trajectory: its ``trajectories`` row
      │         └─ generate                          LLM    … and a branch forks at the tool result it shares
      │              └─ leaf 5 · branch · wrong · r=0.00
      └─ generate …                                         the next global path

Every segment is one span, once, under the segment it follows (a shared prefix is not repeated per leaf, and a
branch point is where the span tree forks); each trajectory ends in a zero-length CHAIN span named by its kind,
reward reason and reward. Before, each leaf repeated its whole path (a shared node showed up under three leaves with
three different durations), branch points were visible only in attributes, and leaves were named ``leaf 1``.

Why a trace per tree, not per leaf: the group is what GRPO-style advantages compare (rewards and advantages of
the leaves side by side), and writing a trace costs one store transaction (≈ 60 ms on SQLite, loaded 2-core CPU):
the 12 leaves of 3 scripted questions took 1.37 s to write as leaf traces, 0.32 s as tree traces.

Span attributes are the Parquet rows of :mod:`infra.store` (:func:`~aepo_core.rollout.rows.node_row`,
:func:`~aepo_core.rollout.rows.leaf_row`; same names, same values), so a span joins its Parquet row on
(run_id, step, question_id, node_id / leaf_id). Left out of the attributes: the token arrays and the texts; a
text is the span's output instead (the segment's text, the tool's result, the response), cut to
:data:`TEXT_CHARS` characters (the Parquet row keeps it whole); an LLM span's input is the tail of the text it
continued (:data:`CONTEXT_CHARS`).

Timing: the rollout records a latency per tool call and a wall time per trajectory (from its fork, for a
branch), not per model segment (generation is batched across paths). Tool spans last their measured latency; model
segments share the rest of a trajectory's wall time in proportion to their tokens (``aepo.duration_estimated``;
a shared segment is timed by the first trajectory through it); a segment starts when the one it follows ends, and
the latest-ending path ends at ``end_ns``.

Spans are MLflow's own span entities (:class:`~mlflow.entities.LiveSpan` over OpenTelemetry spans of a private
tracer provider, so nothing goes through MLflow's process-global tracer, trace manager or asynchronous exporter):
:func:`write_traces` writes the finished traces with the run's tracking URI
(:meth:`infra.tracking.run.Tracker.log_rollout_traces` does both in a background thread).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mlflow import MlflowClient
from mlflow.entities import LiveSpan, SpanStatus, SpanStatusCode, SpanType, Trace, TraceData, TraceInfo
from mlflow.entities.trace_location import TraceLocation
from mlflow.entities.trace_state import TraceState
from mlflow.tracing.client import TracingClient
from mlflow.tracing.constant import SpansLocation, TraceMetadataKey, TraceTagKey
from mlflow.tracing.utils import generate_mlflow_trace_id_from_otel_trace_id
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from aepo_core.rollout.rows import leaf_row, node_row
from aepo_core.rollout.tree import Leaf, Node, RolloutTree
from aepo_core.scoring import LeafScore
from infra.data.rows import QuestionRow

TraceKind = Literal["train", "eval"]
TEXT_CHARS = 4000  # a span's output text; a Python result or a search page rarely needs more to be read
PREVIEW_CHARS = 1000  # the request / response columns of the traces table
_ROW_ONLY = frozenset({"prompt_tokens", "response_tokens", "loss_mask", "logprobs", "entropies", "response_text",
                       "text", "dataset", "question", "golds", "family"})
"""Parquet columns not copied into attributes: token arrays; texts are outputs; the question (the root span's input)
and its golds, dataset and family, which the trace does not carry per leaf."""
_SEGMENT_KEYS = frozenset({"run_id", "step", "question_id"})  # said once, on the root span
CONTEXT_CHARS = 600  # an LLM span's input: the tail of the text it continued

# Trace tags (searchable in the UI's traces table): what the trace is and where it belongs.
TAG_KIND = "aepo.kind"
TAG_STEP = "aepo.step"
TAG_LABEL = "aepo.label"
TAG_STAGE = "aepo.stage"  # start, sft, step<N>, final, eval (the label without its dataset)
TAG_QUESTION = "aepo.question_id"
KEY_TAGS = (TAG_KIND, TAG_LABEL, TAG_STEP, TAG_QUESTION)
"""The tags that say what a trace is the trace of (:func:`trace_key`): a run has one trace per key."""


class _SystemRandomIds(IdGenerator):
    """Trace and span ids from the OS (:class:`random.SystemRandom`), not from the global ``random`` that
    OpenTelemetry's default generator draws on: a run seeds that one, so every run of one seed, and every resumed
    process of a run, drew the same ids in the same order, and a later trace replaced an earlier one of the same id
    in a shared store (the kill-and-resume chain kept 7 of its 10 traces); the draws, in the background writer's
    thread, also moved the run's own random stream."""

    _rng = random.SystemRandom()

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1  # (0 is OpenTelemetry's invalid id)

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


# Private: no processors, nothing exported by OpenTelemetry; its resource names the service (trace tags).
_tracer = TracerProvider(resource=Resource({"service.name": "aepo"}), id_generator=_SystemRandomIds()
                         ).get_tracer("aepo.traces")


@dataclass(frozen=True)
class TraceTarget:
    """Where traces go: the MLflow experiment and run, the RL step, and what produced them.

    ``kind``: ``train`` (a step's rollouts) or ``eval``; ``label``: the stage (``step3``, ``final``, ``eval``) and,
    for evaluations, the dataset key (``final/gsm8k``).
    """

    experiment_id: str
    run_id: str
    step: int
    kind: TraceKind
    label: str


def cut(text: str, limit: int = TEXT_CHARS) -> str:
    """``text`` up to ``limit`` characters; a cut text ends with how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text)} characters]"


def rollout_traces(target: TraceTarget, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None,
                   questions: Mapping[str, QuestionRow], end_ns: int) -> list[Trace]:
    """One trace per tree (``scores[i][j]``: leaf ``j`` of ``trees[i]``, None: unscored), each ending at
    ``end_ns``; ``questions`` maps question ids to their rows (the root span's inputs: text and gold answers)."""
    return [tree_trace(target, tree, None if scores is None else scores[i], questions.get(tree.question_id), end_ns)
            for i, tree in enumerate(trees)]


def trace_name(target: TraceTarget, question_id: str) -> str:
    """``q17 · step 3`` (a training step's rollout) or ``q17 · final/gsm8k · step 40`` (an evaluation)."""
    return (f"{question_id} · step {target.step}" if target.kind == "train"
            else f"{question_id} · {target.label} · step {target.step}")


def tree_trace(target: TraceTarget, tree: RolloutTree, scores: Sequence[LeafScore] | None,
               question: QuestionRow | None, end_ns: int) -> Trace:
    """The trace of one question's rollout tree: an AGENT root span, a span per segment under the segment it
    follows, and a CHAIN span per leaf under its last segment (see the module docstring)."""
    name = trace_name(target, tree.question_id)
    text = question.question if question is not None else ""
    golds = list(question.golds) if question is not None else []
    rows = [leaf_row(target.run_id, target.step, tree, leaf, None if scores is None else scores[j])
            for j, leaf in enumerate(tree.leaves)]
    duration = _node_durations_ns(tree)
    by_id = {n.node_id: n for n in tree.nodes}
    offset: dict[int, tuple[int, int]] = {}  # node id → (start, end) from the prompt, in ns
    for n in sorted(tree.nodes, key=lambda n: n.node_id):  # a node is created after the one it follows
        start = offset[n.parent_id][1] if n.parent_id in offset else 0
        offset[n.node_id] = (start, start + (0 if n.kind == "prompt" else duration.get(n.node_id, 0)))
    start_ns = end_ns - max((e for _, e in offset.values()), default=0)
    root = _start(name, SpanType.AGENT, None, start_ns)
    root.set_inputs({"question_id": tree.question_id, "question": text, "golds": golds, "stage": target.label,
                     "step": target.step})
    root.set_attributes({"run_id": target.run_id, "step": target.step, "question_id": tree.question_id,
                         "num_leaves": len(tree.leaves), "global_budget": tree.global_budget,
                         **{k: rows[0][k] for k in ("h_root", "h_tool") if rows}})
    spans, finished = [root], []
    span_of: dict[int, LiveSpan] = {}
    for n in sorted(tree.nodes, key=lambda n: n.node_id):
        if n.kind == "prompt":
            continue
        parent = span_of.get(n.parent_id, root) if n.parent_id is not None else root
        begin, end = offset[n.node_id]
        span, ended = _segment_span(target, tree, n, parent, start_ns + begin, start_ns + end,
                                    _context_tail(tree, by_id, n, text))
        span_of[n.node_id] = span
        spans.append(span)
        finished.append(ended)
    for leaf, row in zip(tree.leaves, rows, strict=True):
        last = leaf.node_ids[-1]
        at = start_ns + offset[last][1] if last in offset else end_ns
        span = _start(_leaf_name(leaf, row), SpanType.CHAIN, span_of.get(last, root), at)
        span.set_inputs({"sample_kind": leaf.sample_kind, "path": list(leaf.node_ids)})
        span.set_attributes({k: v for k, v in row.items() if k not in _ROW_ONLY})
        span.end(outputs=cut(row["response_text"]), status=_leaf_status(leaf), end_time_ns=at)
        spans.append(span)
    for end_segment in finished:
        end_segment()
    outcomes = [{k: row[k] for k in ("leaf_id", "status", "reward", "reward_reason", "advantage", "num_tool_calls")}
                for row in rows]
    root.end(outputs=outcomes, status=SpanStatus(SpanStatusCode.OK), end_time_ns=end_ns)
    info = TraceInfo(
        trace_id=root.trace_id, trace_location=TraceLocation.from_experiment_id(target.experiment_id),
        request_time=start_ns // 1_000_000, execution_duration=(end_ns - start_ns) // 1_000_000, state=TraceState.OK,
        request_preview=cut(f"[{target.label} · step {target.step}] {text}", PREVIEW_CHARS),
        response_preview=cut(_outcome_line(rows), PREVIEW_CHARS),
        trace_metadata={TraceMetadataKey.SOURCE_RUN: target.run_id},
        tags={TraceTagKey.TRACE_NAME: name, TAG_STAGE: target.label.split("/")[0],
              **dict(zip(KEY_TAGS, trace_key(target, tree.question_id), strict=True))},
    )
    return Trace(info=info, data=TraceData(spans=[s.to_immutable_span() for s in spans]))


def _leaf_name(leaf: Leaf, row: Mapping[str, Any]) -> str:
    """``leaf 5 · branch · wrong · r=0.00``: the trajectory's kind, how it ended and its reward."""
    reward = f" · r={row['reward']:.2f}" if row["reward"] is not None else ""
    return f"leaf {leaf.leaf_id} · {leaf.sample_kind} · {row['reward_reason'] or leaf.status}{reward}"


def _context_tail(tree: RolloutTree, by_id: Mapping[int, Node], node: Node, question: str) -> str:
    """The last :data:`CONTEXT_CHARS` characters of what ``node`` continued: the question, then the texts of the
    segments before it on its path (the chat template around them is left out)."""
    texts, at = [], by_id.get(node.parent_id) if node.parent_id is not None else None
    while at is not None and at.kind != "prompt" and sum(map(len, texts)) < CONTEXT_CHARS:
        texts.append(at.text)
        at = by_id.get(at.parent_id) if at.parent_id is not None else None
    context = question + "".join(reversed(texts))
    return context if len(context) <= CONTEXT_CHARS else f"…{context[-CONTEXT_CHARS:]}"


def _outcome_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """The traces table's response column: each leaf's reward reason (``correct``, ``wrong`` …) and reward."""
    return "; ".join(f"leaf {r['leaf_id']}: {r['reward_reason'] or r['status']}"
                     + (f" ({r['reward']:.2f})" if r["reward"] is not None else "") for r in rows)


def _start(name: str, span_type: str, parent: LiveSpan | None, start_ns: int) -> LiveSpan:
    """A live MLflow span on the private tracer, started at ``start_ns`` (a root span starts a new trace)."""
    ctx = otel_trace.set_span_in_context(parent._span) if parent is not None else None
    otel = _tracer.start_span(name, context=ctx, start_time=start_ns)
    trace_id = (parent.trace_id if parent is not None
                else generate_mlflow_trace_id_from_otel_trace_id(otel.get_span_context().trace_id))
    return LiveSpan(otel, trace_id, span_type)


def _segment_span(target: TraceTarget, tree: RolloutTree, node: Node, parent: LiveSpan, start_ns: int,
                  end_ns: int, context: str) -> tuple[LiveSpan, Callable[[], None]]:
    """A model segment (LLM span: entropy, ΔH, branch decision; input: the tail of the text it continued) or a tool
    call (TOOL span: argument, result, latency, cache hit, error; GUARDRAIL for the scheduler's notices), with its
    ``nodes`` row as attributes; returned with the call that ends it (after its children are started)."""
    row = node_row(target.run_id, target.step, tree, node)
    attrs = {k: v for k, v in row.items() if k not in _ROW_ONLY and k not in _SEGMENT_KEYS}
    if node.tool is None:
        span = _start("generate", SpanType.LLM, parent, start_ns)
        span.set_inputs({"context": context, "context_tokens": node.token_start})
        attrs = {k: v for k, v in attrs.items() if not k.startswith("tool_")}
        attrs["aepo.duration_estimated"] = True
        status = SpanStatus(SpanStatusCode.OK)
    else:
        # The scheduler's notices (a call past the limit, a malformed call) ran no tool: the guard said no.
        span = _start(node.tool.name, SpanType.GUARDRAIL if node.tool.is_notice else SpanType.TOOL, parent, start_ns)
        span.set_inputs({"argument": node.tool.argument})
        status = (SpanStatus(SpanStatusCode.OK) if node.tool.ok
                  else SpanStatus(SpanStatusCode.ERROR, node.tool.error or "tool call failed"))
    span.set_attributes(attrs)
    return span, lambda: span.end(outputs=cut(node.text), status=status, end_time_ns=end_ns)


def _leaf_status(leaf: Leaf) -> SpanStatus:
    """ERROR for trajectories that ended on an engine error (the model never finished); OK otherwise — a wrong
    answer, a truncation or a failed tool call is an outcome of the policy, shown by the attributes."""
    if leaf.status == "engine_error":
        return SpanStatus(SpanStatusCode.ERROR, "engine_error")
    return SpanStatus(SpanStatusCode.OK)


def _durations_ns(segments: Sequence[Node], leaf: Leaf) -> list[int]:
    """Each segment's duration on ``leaf``'s path: tool calls their latency, model segments the rest of the leaf's
    wall time shared by token count (all zero when the leaf has no wall time, e.g. a scripted engine). Rounded at
    the cumulative boundaries, so they add up to the leaf's time to the nanosecond."""
    tool_s = sum(n.tool.latency_s for n in segments if n.tool is not None)
    model_tokens = sum(len(n.token_ids) for n in segments if n.tool is None) or 1
    model_s = max(0.0, leaf.wall_s - tool_s)
    bounds, t = [0], 0.0
    for n in segments:
        t += n.tool.latency_s if n.tool is not None else model_s * len(n.token_ids) / model_tokens
        bounds.append(round(t * 1e9))
    return [b - a for a, b in itertools.pairwise(bounds)]


def _node_durations_ns(tree: RolloutTree) -> dict[int, int]:
    """Each segment's duration, from the first leaf whose path holds it (:func:`_durations_ns`)."""
    out: dict[int, int] = {}
    for leaf in tree.leaves:
        segments = [n for n in tree.path(leaf) if n.kind != "prompt"]
        for node, d in zip(segments, _durations_ns(segments, leaf), strict=True):
            out.setdefault(node.node_id, d)
    return out


TraceKey = tuple[str, str, str, str]
"""What a trace is the trace of: (kind, label, step, question id), the values of its :data:`KEY_TAGS`."""


def trace_key(target: TraceTarget, question_id: str) -> TraceKey:
    return target.kind, target.label, str(target.step), question_id


def logged_trace_keys(client: MlflowClient, experiment_id: str, run_id: str) -> frozenset[TraceKey]:
    """The keys of the traces ``run_id`` has (without their spans): a resumed run that repeats a stage whose traces
    were written before the kill skips them, as it skips the metric points it has."""
    keys: set[TraceKey] = set()
    token = None
    while True:
        page = client.search_traces(locations=[experiment_id], run_id=run_id, max_results=500, page_token=token,
                                    include_spans=False)
        keys.update(tuple(t.info.tags.get(tag, "") for tag in KEY_TAGS) for t in page)
        token = page.token
        if not token:
            return frozenset(keys)


def write_traces(tracking_uri: str, traces: Sequence[Trace]) -> list[str]:
    """Write finished traces to the tracking store at ``tracking_uri``, the way MLflow's own exporter does but
    synchronously and with this URI: the spans first (a SQL store keeps them in its tables), then each trace's
    info; a store that keeps no spans gets them as the trace's artifact. Returns the trace ids."""
    if not traces:
        return []
    tracing = TracingClient(tracking_uri)
    experiment_id = traces[0].info.experiment_id
    in_store = True
    try:
        tracing.log_spans(experiment_id, [s for t in traces for s in t.data.spans])
    except NotImplementedError:
        in_store = False
    ids = []
    for t in traces:
        info = tracing.start_trace(t.info)
        if not in_store or info.tags.get(TraceTagKey.SPANS_LOCATION) != SpansLocation.TRACKING_STORE.value:
            tracing._upload_trace_data(info, t.data)  # the exporter's own fallback (no public equivalent)
        ids.append(info.trace_id)
    return ids


def attributes(span: Any) -> dict[str, Any]:
    """A span's own attributes, without MLflow's ``mlflow.*`` bookkeeping (what a reader compares to the rows)."""
    return {k: v for k, v in span.attributes.items() if not k.startswith("mlflow.")}


__all__ = ["TEXT_CHARS", "TraceTarget", "attributes", "cut", "rollout_traces", "trace_name", "tree_trace",
           "write_traces"]
