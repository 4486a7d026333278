"""The round loop of dynamic entropy-balanced rollout (AEPO.md §1–4).

For a batch of questions: batched generate for every active path → dispatch the tool calls of the round in
parallel → append results as separately tokenized ids (loss mask 0) → branch decisions → fill the budget.

Modes:
- ``aepo``: one probe per question first (batched); m from its entropies (``budget_rule``); consecutive branch
  penalty λ.  With ``premonitor`` off, m = ``initial_rollouts``.  The probe never branches while it measures.
  ``probe: discard`` (the default, the published code) throws it away and starts m fresh globals.
  ``probe: reuse`` keeps it as the first global sample: when it ends, the question's tree is rewound to the prompt
  and the probe's stored segments and tool results are replayed one per round beside the m − 1 new globals, so its
  tool steps fall in the same rounds and order as theirs (as if all m had started together), and no token is
  sampled twice.  Its entropies set m, so when β ≠ 0 they must not also drive its own decisions (a probe whose
  post-tool entropy is high would both lower m, opening branch budget, and branch more: 0.759 vs 0.687 branches
  on the first global's path at β = 0.5, tests/core/test_rollout_fairness.py): its steps are then recorded
  (reason ``probe``) and never branch.  At β = 0, m does not depend on it and it decides like any global.
- ``arpo``: m = ``initial_rollouts``, the same branch rule with λ = 0.
- ``independent``: k global samples, no branching (GRPO-style rollouts).

A branch is decided on the model segment that follows a real tool result (never after the scheduler's own
'limit'/'invalid' notices), from the entropy of its first W tokens; it forks ``beam_size − 1`` paths from the
tool-result node, each an exact copy of the path's state right after that result, which sample their own
continuation.  No question ever gets more than k leaves; when all its paths are done with budget left, fresh
global samples fill it.  All m global samples start before any branch decision of their question.

Tool calls of a round run in parallel, at most ``tool_workers`` at a time; each is timed out
``tool_timeout_s`` after its own start, so waiting for a worker never counts against it.

A turn the segment cap (``max_segment_tokens``) cuts into several segments is one turn: its stop strings are
found in the text of the whole turn, and a segment that runs past a stop string split across the cap boundary
is cut right after the token that completes it (engines see only their own request's tokens).

Phases advance per question (probe → m globals, the probe replayed or discarded → fill), never behind a batch-wide
barrier, so one slow question does not hold the others' work back.

Everything that touches the outside world is handed in: the engine (token ids in and out) and the tools.

Randomness is keyed by what a path is, never by when things happen: a path's identity is ``g<j>`` (the j-th global
sample), ``f<j>`` (fill), ``probe`` (a discarded probe) or ``<parent>/<step>.<b>`` (the b-th fork made at the
parent's tool step ``step``).  A question's identity is its ``question_id`` (``<id>#<n>`` for the n-th repeat of
an id within one batch), never its position in the batch.  Segment seeds are derived from (seed, question, path,
segment), and each branch decision's uniform draw from (seed, question, path, tool step), so a question's tree does
not depend on what else is in its batch or in which order, and two arms that reach the same decision (same
question, path and step) draw the same u: their decisions are paired.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

from aepo_core.config import RolloutConfig
from aepo_core.entropy import published_segment_entropy, segment_entropy
from aepo_core.interfaces import Engine, GenerationRequest, GenerationResult, SamplingParams, Tool, ToolResult
from aepo_core.protocol import ANSWER_CLOSE, STOP_STRINGS, ToolCall, parse_tool_call, result_block
from aepo_core.rollout.branching import BranchDecision, branch_decision, consecutive_branch_count
from aepo_core.rollout.budget import (
    fixed_budget,
    global_budget,
    mean_tool_entropy,
    official_global_budget,
    official_tool_entropy,
)
from aepo_core.rollout.stats import rollout_stats
from aepo_core.rollout.tree import Leaf, LeafStatus, Node, RolloutTree, SampleKind, ToolEvent, is_tool_step

log = logging.getLogger(__name__)

TOOL_LIMIT_MESSAGE = "Tool call limit reached ({limit} calls). No more tools: give your final answer now."
TOOL_THREAD_HEADROOM = 4  # tool threads per tool worker: room for calls abandoned after their timeout
UNKNOWN_TOOL_MESSAGE = "Tool {name!r} is not available. Available tools: {available}."


@dataclass(frozen=True)
class Question:
    """A question whose chat template has been applied once: the transcript only ever grows by token ids."""

    question_id: str
    prompt_ids: Sequence[int]


@dataclass
class _ProbeRecord:
    """What a probe got, in order: the engine's results per segment and the tools' results per real call."""

    segments: list[GenerationResult] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)


@dataclass
class _Path:
    """A trajectory being generated (internal state; becomes a Leaf when done)."""

    question_key: str  # the question's identity in the seeds (module docstring)
    leaf_id: int
    node_ids: list[int]
    kind: SampleKind
    key: str  # the path's identity, which seeds its segments and its decisions (module docstring)
    response_len: int = 0
    tool_calls: int = 0
    segments: int = 0
    step_history: list[bool] = field(default_factory=list)
    h_init: float | None = None
    after_tool: bool = False  # the next segment follows a real tool result (a tool step; notices are none)
    fork_pending: bool = False  # the next segment is a fork's first: its step already branched
    limit_notice: bool = False
    last_tool_failed: bool = False
    record: _ProbeRecord | None = None  # the probe, while it measures: what it got, for a replay
    replay: _ProbeRecord | None = None  # the reused probe: served from its record instead of the engine and tools
    set_budget: bool = False  # the reused probe whose entropies set m (β ≠ 0): its steps take no decision
    status: LeafStatus | None = None
    started: float = field(default_factory=time.perf_counter)
    wall_s: float = 0.0


@dataclass
class _QuestionState:
    key: str  # the question's identity in the seeds: its id, ``<id>#<n>`` for the n-th repeat in the batch
    question: Question
    nodes: list[Node]
    paths: list[_Path] = field(default_factory=list)
    m: int = 0
    h_root: float = math.nan
    h_tool: float = math.nan
    root_sample_entropy: float = math.nan  # budget_rule official: the separate root sample's segment entropy
    fills: int = 0
    probing: bool = False  # the pre-monitoring probe is still running (aepo with premonitor)
    fork_points: dict[int, _Path] = field(default_factory=dict)  # real tool-result node → path state just after it

    @property
    def leaves_started(self) -> int:
        return len(self.paths)

    @property
    def globals_started(self) -> int:
        """Global samples started so far (the probe included); forks and fill samples do not count."""
        return sum(1 for p in self.paths if p.kind == "global")

    @property
    def probe(self) -> _Path:
        return self.paths[0]


ToolJob = tuple[_QuestionState, _Path, "ToolCall | None", "str | None"]
"""A tool step of a path: the call to run, or the notice (a limit or an invalid call) that stands for it."""


class EngineFailure(RuntimeError):
    """Requests the engine could not answer after its own retries (a dead or overloaded server, an out-of-memory
    error): the rollout that met them returns nothing, so no failed leaf is ever scored, stored or trained on.
    ``engine`` names the engine in the message (the runtime sets it, :meth:`on`)."""

    def __init__(self, failed: int, requests: int, first_error: str, engine: str = "the engine") -> None:
        self.failed, self.requests, self.first_error, self.engine = failed, requests, first_error, engine
        super().__init__(f"{engine} failed {failed} of {requests} requests (after its own retries); the first: "
                         f"{first_error}. Nothing of this rollout was scored or stored")

    def on(self, engine: str) -> EngineFailure:
        """The same failure, naming ``engine``."""
        return EngineFailure(self.failed, self.requests, self.first_error, engine)


@dataclass
class RolloutResult:
    trees: list[RolloutTree]
    stats: dict[str, float]
    branch_rate_by_consecutive: dict[int, float]

    def weight_versions(self) -> Counter[str | None]:
        """Model segments per weight version (None: the engine does not track versions)."""
        return Counter(n.weight_version for tree in self.trees for n in tree.nodes if n.kind == "model")

    def metrics(self) -> dict[str, float]:
        """``rollout/<stat>``: the names under which the batch statistics (:func:`rollout_stats`, plus wall, generate
        and tool seconds and generated tokens) are tracked."""
        return {f"rollout/{name}": value for name, value in self.stats.items()}

    def describe(self) -> str:
        """``4 questions, 16 leaves (8 global, 8 branch), 2400 tokens in 12.5 s``: the rollout in one line."""
        s = self.stats
        return (f"{s.get('questions', 0):.0f} questions, {s.get('leaves', 0):.0f} leaves "
                f"({s.get('global_samples', 0):.0f} global, {s.get('branch_samples', 0):.0f} branch), "
                f"{s.get('tokens_generated', 0):.0f} tokens in {s.get('wall_s', 0):.1f} s")


def merge_results(parts: Sequence[RolloutResult]) -> RolloutResult:
    """One rollout from the shards that data-parallel ranks rolled out (trees in rank order).

    The tree statistics are recomputed over all trees; wall, generate and tool seconds are the slowest shard's
    (the ranks ran concurrently), generated and prompt tokens and stale segments are summed; the branch rate by
    consecutive-branch count and any other statistic are the first shard's (the decisions behind them are not in
    a result).
    """
    if len(parts) == 1:
        return parts[0]
    trees = [t for p in parts for t in p.trees]
    stats = {**parts[0].stats, **rollout_stats(trees)[0]}
    for key in ("wall_s", "generate_s", "tools_s"):
        stats[key] = max(p.stats.get(key, 0.0) for p in parts)
    for key in ("tokens_generated", "prompt_tokens", "stale_segments"):
        if any(key in p.stats for p in parts):
            stats[key] = sum(p.stats.get(key, 0.0) for p in parts)
    return RolloutResult(trees, stats, dict(parts[0].branch_rate_by_consecutive))


def question_keys(questions: Sequence[Question]) -> list[str]:
    """Each question's identity in the seeds: its id, and ``<id>#<n>`` for the n-th (n ≥ 1) repeat of that id in
    the batch, so that a question asked twice gets two samples, not one sample twice."""
    seen: Counter[str] = Counter()
    keys = []
    for q in questions:
        n = seen[q.question_id]
        seen[q.question_id] += 1
        keys.append(q.question_id if n == 0 else f"{q.question_id}#{n}")
    return keys


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RolloutScheduler:
    def __init__(
        self,
        engine: Engine,
        tools: Mapping[str, Tool],
        cfg: RolloutConfig,
        *,
        tool_timeout_s: float = 30.0,
        tool_workers: int = 8,
    ) -> None:
        self.engine = engine
        self.tools = dict(tools)
        self.cfg = cfg
        self.tool_timeout_s = tool_timeout_s
        self.tool_workers = tool_workers

    # ------------------------------------------------------------------ public
    def run(self, questions: Sequence[Question], seed: int, sampling: SamplingParams | None = None) -> RolloutResult:
        cfg = self.cfg
        sampling = sampling or SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k)
        if cfg.entropy_scale == "official":  # the rules read the published terms: ask the engine for them
            sampling = replace(sampling, published_entropy=True)
        self._timers = {"generate_s": 0.0, "tools_s": 0.0}
        self._counting = threading.Lock()  # generate calls may run in threads (rollout.inflight_requests)
        self._calls_out = 0  # generate calls in flight
        self._busy_since = 0.0  # when the first of them went out
        self._generated_tokens = 0
        self._prompt_tokens = 0
        self._decisions: list[tuple[int, bool]] = []
        self._requests = 0
        self._engine_errors: list[str] = []
        self._seed = seed
        states = [_QuestionState(key, q, [Node(0, None, 0, "prompt", list(q.prompt_ids))])
                  for key, q in zip(question_keys(questions), questions, strict=True)]
        start = time.perf_counter()
        # Headroom past tool_workers: threads of abandoned (timed-out) calls keep running until their tool returns,
        # and the calls after them must still start at once (_run_calls caps live calls at tool_workers).
        self._pool = ThreadPoolExecutor(max_workers=TOOL_THREAD_HEADROOM * self.tool_workers,
                                        thread_name_prefix="aepo-tool")
        self._slots = threading.Semaphore(self.tool_workers)  # live calls, over every batch of calls in flight
        try:
            premonitor = cfg.mode == "aepo" and cfg.premonitor
            if premonitor and cfg.budget_rule == "official":
                self._sample_roots(states, sampling)
            for st in states:
                if premonitor:
                    st.probing = True
                    probe = self._new_path(st, "global", key="g0" if cfg.probe == "reuse" else "probe")
                    probe.record = _ProbeRecord()
                else:
                    st.m = cfg.k if cfg.mode == "independent" else fixed_budget(cfg.k, cfg.initial_rollouts)
                    self._start_globals(st)
            self._run_rounds(states, sampling)
        finally:  # a hung tool call must not hold the rollout back after it has been timed out
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._engine_errors:  # a fault is never data: no tree of this rollout is returned
            raise EngineFailure(len(self._engine_errors), self._requests, self._engine_errors[0])
        trees = [self._finish(st) for st in states]
        total = time.perf_counter() - start
        stats, by_l = rollout_stats(trees, self._decisions)
        stats.update(
            {
                "wall_s": total,
                "generate_s": self._timers["generate_s"],
                "tools_s": self._timers["tools_s"],
                "tokens_generated": float(self._generated_tokens),
                "prompt_tokens": float(self._prompt_tokens),
            }
        )
        return RolloutResult(trees, stats, by_l)

    # ------------------------------------------------------------------ paths
    def _new_path(self, st: _QuestionState, kind: SampleKind, key: str | None = None) -> _Path:
        """A fresh trajectory from the prompt (a global or fill sample): ``g<j>`` / ``f<j>`` unless ``key``."""
        if key is None:
            key = f"g{st.globals_started}" if kind == "global" else f"f{st.fills}"
        if kind == "fill":
            st.fills += 1
        path = _Path(question_key=st.key, leaf_id=st.leaves_started, node_ids=[0], kind=kind, key=key)
        st.paths.append(path)
        return path

    def _fork(self, st: _QuestionState, tool_node: int, history: list[bool], branch: int) -> _Path:
        """A branch from a tool-result node: an exact copy of its path's state right after that result was
        appended (tool calls, notices, whether the call failed, length, h_init), with the step history that
        the branch decision gave it, sampling its own continuation (``branch``: its number among the forks of
        that decision, 1..beam_size − 1)."""
        point = st.fork_points[tool_node]
        # The step's index is the decision's (``history`` ends with it): the point's own history may lack a decision
        # still pending when the result came back (rollout.scheduling per_path); in the round loop they agree.
        key = f"{point.key}/{len(history) - 1}.{branch}"
        path = replace(point, leaf_id=st.leaves_started, kind="branch", key=key, node_ids=list(point.node_ids),
                       step_history=list(history), fork_pending=True, record=None, replay=None, set_budget=False,
                       started=time.perf_counter())
        st.paths.append(path)
        return path

    # ------------------------------------------------------------------ rounds
    def _run_rounds(self, states: list[_QuestionState], sampling: SamplingParams) -> None:
        """Rounds until every path of every question is done.

        Phases advance per question, never behind a global barrier: a question whose probe is done starts its
        m − 1 global samples at once, and one whose paths are all done fills its budget while others still run.
        A question's own events happen in the same order either way, so its tree does not depend on the others.
        """
        branching = self.cfg.mode != "independent"
        while True:
            for st in states:
                while not any(p.status is None for p in st.paths) and self._advance(st):
                    pass
            active = [(st, p) for st in states for p in st.paths if p.status is None]
            if not active:
                return
            results = self._generate(states, active, sampling)
            tool_jobs: list[ToolJob] = []
            for (st, p), res in zip(active, results, strict=True):
                job = self._absorb_segment(st, p, res, branching and not st.probing)
                if job is not None:
                    tool_jobs.append((st, p, *job))
            if tool_jobs:
                self._dispatch_tools(tool_jobs)

    def _advance(self, st: _QuestionState) -> bool:
        """A question with no active path: probe done → budget, rewind, globals; else fill up to k. False: done."""
        if st.probing:
            st.probing = False
            self._premonitor(st)
            record = st.probe.record
            st.nodes, st.paths, st.fork_points = st.nodes[:1], [], {}
            if self.cfg.probe == "reuse":
                kept = self._new_path(st, "global")
                kept.replay, kept.set_budget = record, self.cfg.beta != 0.0
            self._start_globals(st)
            return True
        if st.leaves_started >= self.cfg.k:
            return False
        while st.leaves_started < self.cfg.k:
            self._new_path(st, "fill")
        return True

    def _start_globals(self, st: _QuestionState) -> None:
        """Start global samples until there are m of them: forks already made from the probe are branch
        budget and must not stand in for globals."""
        while st.globals_started < st.m:
            self._new_path(st, "global")

    def _generate(self, states: list[_QuestionState], active: list[tuple[_QuestionState, _Path]],
                  sampling: SamplingParams) -> list[GenerationResult]:
        """The next segment of every active path: from the engine, or from its record for a replayed probe."""
        results: list[GenerationResult | None] = [
            p.replay.segments[p.segments] if p.replay and p.segments < len(p.replay.segments) else None
            for _, p in active
        ]
        live = [i for i, r in enumerate(results) if r is None]
        if live:
            sampled = iter(self._sample([active[i] for i in live], sampling))
            for i in live:
                results[i] = next(sampled)
                p = active[i][1]
                if p.record is not None:
                    p.record.segments.append(results[i])
        return [r for r in results if r is not None]

    def _sample(self, active: list[tuple[_QuestionState, _Path]], sampling: SamplingParams) -> list[GenerationResult]:
        cfg = self.cfg
        requests = []
        for st, p in active:
            remaining = cfg.max_response_tokens - p.response_len
            cap = min(remaining, cfg.max_segment_tokens) if cfg.max_segment_tokens else remaining
            ids = [t for i in p.node_ids for t in st.nodes[i].token_ids]
            seed = derive_seed(self._seed, p.question_key, p.key, p.segments)
            requests.append(GenerationRequest(ids, max(1, cap), STOP_STRINGS, seed=seed))
        return self._engine_generate(requests, sampling)

    def _engine_generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        """The engine's results, timed and their tokens counted; a batch that fails is retried row by row.
        ``generate_s`` is the time the engine had a call in flight: calls out together (rollout.inflight_requests)
        count once, so it stays a share of the wall time."""
        with self._counting:
            if not self._calls_out:
                self._busy_since = time.perf_counter()
            self._calls_out += 1
        try:
            results = self.engine.generate(requests, sampling)
            if len(results) != len(requests):
                raise RuntimeError(f"engine returned {len(results)} results for {len(requests)} requests")
        except Exception as exc:  # a batch that fails is retried row by row: each row's own error is then known
            log.warning("batched generation failed (%s); retrying %d rows one by one", exc, len(requests))
            results = [self._generate_one(r, sampling) for r in requests]
        with self._counting:
            self._calls_out -= 1
            if not self._calls_out:
                self._timers["generate_s"] += time.perf_counter() - self._busy_since
            self._prompt_tokens += sum(len(r.prompt_ids) for r in requests)  # sent, retried row by row or not
            self._requests += len(requests)
            self._engine_errors += [r.error or "error" for r in results if r.finish_reason == "error" or r.error]
            self._generated_tokens += sum(len(r.token_ids) for r in results)  # engine work, tokens cut later too
        return results

    def _generate_one(self, request: GenerationRequest, sampling: SamplingParams) -> GenerationResult:
        try:
            (res,) = self.engine.generate([request], sampling)
            return res
        except Exception as exc:
            return GenerationResult([], [], [], "error", error=f"{type(exc).__name__}: {exc}")

    def _absorb_segment(self, st: _QuestionState, p: _Path, res: GenerationResult,
                        branching: bool) -> tuple[ToolCall | None, str | None] | None:
        """Append the generated segment, decide a branch if this is a tool step, and classify how it ended.

        Returns a tool job (call, or a notice text for calls that must not run) when the segment ends in a
        tool call.
        """
        cfg = self.cfg
        if res.finish_reason == "error" or res.error:  # the path ends; run() then raises EngineFailure
            self._close(p, "engine_error")
            log.warning("engine error on question %s leaf %d: %s", st.question.question_id, p.leaf_id, res.error)
            return None
        res = self._cut_at_first_stop(self._turn_text(st, p), res)
        parent = st.nodes[p.node_ids[-1]]
        text = self.engine.decode(res.token_ids)
        node = Node(
            node_id=len(st.nodes),
            parent_id=parent.node_id,
            depth=parent.depth + 1,
            kind="model",
            token_ids=list(res.token_ids),
            logprobs=list(res.logprobs),
            entropies=list(res.entropies),
            token_start=parent.token_end if parent.kind != "prompt" else 0,
            text=text,
            finish_reason=res.finish_reason,
            segment_entropy=self._segment_entropy(res),
            entropy_is_estimate=res.entropy_is_estimate,
            weight_version=res.weight_version,
        )
        st.nodes.append(node)
        p.node_ids.append(node.node_id)
        p.segments += 1
        p.response_len += len(res.token_ids)
        if p.h_init is None:
            p.h_init = node.segment_entropy
        if p.after_tool:
            p.after_tool = False
            if p.fork_pending:
                p.fork_pending = False
                node.branch_reason = "fork"
            elif branching and p.set_budget:
                node.delta_entropy = node.segment_entropy - (p.h_init if p.h_init is not None else math.nan)
                node.branch_reason = "probe"
                p.step_history.append(False)
            elif branching:
                self._decide(st, p, node, budget_left=cfg.k - st.leaves_started)

        # A turn may span several segments when the segment cap cuts it: parse and detect stops on the whole turn.
        turn = self._turn_text(st, p)
        finish, stop = res.finish_reason, res.stop_string
        if finish == "length" and not res.token_ids:
            self._close(p, "truncated")  # no progress possible (zero-token budget)
            return None
        if finish == "eos" or (finish == "stop" and stop == ANSWER_CLOSE):
            self._close(p, "answered")
            return None
        if finish == "stop" and stop in STOP_STRINGS:
            # The token that completed the stop string may carry text past it: parse up to the stop only.
            call = parse_tool_call(turn[: turn.rfind(stop) + len(stop)])
            if p.limit_notice:
                self._close(p, "tool_limit")
                return None
            if p.response_len >= cfg.max_response_tokens:
                self._close(p, "truncated")
                return None
            if call is None:
                return None, f"Malformed tool call: no matching opening tag for {stop}."
            if p.tool_calls >= cfg.max_tool_calls:
                p.limit_notice = True
                return None, TOOL_LIMIT_MESSAGE.format(limit=cfg.max_tool_calls)
            if call.name not in self.tools:
                return None, UNKNOWN_TOOL_MESSAGE.format(name=call.name, available=", ".join(sorted(self.tools)))
            return call, None
        if p.response_len >= cfg.max_response_tokens:
            self._close(p, "tool_error" if p.last_tool_failed else "truncated")
        # else: the segment cap was hit with budget left; the path continues in the next round
        return None

    def _segment_entropy(self, res: GenerationResult) -> float:
        """What the rules read of a segment, on ``rollout.entropy_scale``: the mean entropy (nats) of its first W
        tokens, or the published code's sum of top-10 terms ÷ ln|V| over them."""
        if self.cfg.entropy_scale == "nats":
            return segment_entropy(res.entropies, self.cfg.entropy_window)
        if res.published_entropies is None:
            raise ValueError(f"rollout.entropy_scale=official needs the engine's top-10 entropy terms, which "
                             f"{type(self.engine).__name__} does not report; use rollout.entropy_scale=nats")
        return published_segment_entropy(res.published_entropies, self.cfg.entropy_window)

    def _cut_at_first_stop(self, turn: str, res: GenerationResult) -> GenerationResult:
        """The segment cut right after the token that completes the turn's first stop string.

        An engine matches stop strings in the tokens of its own request only, so when the segment cap splits a
        stop string (``</se`` | ``arch>…``) it runs on past it, to EOS or the cap.  The scheduler sees the whole
        turn and cuts here, for every engine (a remote server cannot be told about the earlier text).  The cut is
        exact: sampling is autoregressive, so the kept tokens are the ones an engine that saw the whole turn
        would have produced; the tokens past the stop (EOS included) are dropped, never trained on.  A segment
        that already ends at its stop string comes back unchanged.
        """
        if not res.token_ids:
            return res
        tail = turn[-(max(map(len, STOP_STRINGS)) - 1) :] if turn else ""
        text = tail + self.engine.decode(res.token_ids)
        hits = [(text.find(s) + len(s), s) for s in STOP_STRINGS if s in text]
        if not hits:
            return res
        end, stop = min(hits)
        if end == len(text) and res.finish_reason == "stop":
            return res
        n = next(n for n in range(1, len(res.token_ids) + 1) if stop in tail + self.engine.decode(res.token_ids[:n]))
        return replace(res, token_ids=res.token_ids[:n], logprobs=res.logprobs[:n],
                       entropies=res.entropies[:n], finish_reason="stop", stop_string=stop)

    @staticmethod
    def _turn_text(st: _QuestionState, p: _Path) -> str:
        """Text of the trailing run of model segments of the path (the current turn)."""
        parts: list[str] = []
        for i in reversed(p.node_ids):
            node = st.nodes[i]
            if node.kind != "model":
                break
            parts.append(node.text)
        return "".join(reversed(parts))

    def _decide(self, st: _QuestionState, p: _Path, node: Node, budget_left: int) -> None:
        """Branch rule at a tool step (AEPO.md §4); forks share the prefix up to the tool-result node."""
        cfg = self.cfg
        lam = 0.0 if cfg.mode == "arpo" else cfg.branch_penalty
        l_count = consecutive_branch_count(p.step_history)
        h_init = p.h_init if p.h_init is not None else node.segment_entropy
        delta = node.segment_entropy - h_init
        u = random.Random(derive_seed(self._seed, p.question_key, p.key, "u", len(p.step_history))).random()
        d: BranchDecision = branch_decision(u, delta, l_count, gamma=cfg.gamma, tau=cfg.tau, lam=lam)
        branched = d.branch and budget_left > 0
        node.delta_entropy = delta
        node.consecutive_branches = l_count
        node.branch_score = d.score
        node.branched = branched
        node.branch_reason = "budget_full" if d.branch and not branched else d.reason
        if budget_left > 0:  # the rule's own branch rate, not confounded by a full budget
            self._decisions.append((l_count, branched))
        if branched:
            fork_from = node.parent_id
            assert fork_from is not None
            for b in range(1, min(cfg.beam_size - 1, budget_left) + 1):
                self._fork(st, fork_from, [*p.step_history, True], b)
        p.step_history.append(branched)

    def _dispatch_tools(self, jobs: list[ToolJob]) -> None:
        """Run the round's tool calls in parallel and append each result (or notice) to its path, in job order."""
        t0 = time.perf_counter()
        self._apply_tool_results(jobs, self._tool_results(jobs))
        self._timers["tools_s"] += time.perf_counter() - t0

    def _tool_results(self, jobs: list[ToolJob]) -> list[ToolResult]:
        """The result of each job: a notice for a call that must not run, the record's for a replayed probe, else the
        tool's (the calls run in parallel, :meth:`_run_calls`). Reads the paths, changes nothing: it may run in a
        thread while the loop goes on with other questions."""
        replayed = [p.replay.tool_results[p.tool_calls] if call is not None and p.replay
                    and p.tool_calls < len(p.replay.tool_results) else None for _, p, call, _ in jobs]
        results = iter(self._run_calls([call for (_, _, call, _), r in zip(jobs, replayed, strict=True)
                                        if call is not None and r is None]))
        out = []
        for (_, p, call, notice), cached in zip(jobs, replayed, strict=True):
            if call is None:
                assert notice is not None
                name = "limit" if p.limit_notice else "invalid"
                out.append(ToolResult(notice, ok=False, error=name))
            else:
                out.append(cached or next(results))
        return out

    def _apply_tool_results(self, jobs: list[ToolJob], results: list[ToolResult]) -> None:
        """Append each job's result to its path, in job order."""
        for (st, p, call, _), result in zip(jobs, results, strict=True):
            if call is None:
                event = ToolEvent(result.error or "invalid", "", False, result.error, 0.0, False, len(result.text))
            else:
                if p.record is not None:
                    p.record.tool_results.append(result)
                event = ToolEvent(call.name, call.argument, result.ok, result.error, result.latency_s,
                                  result.cache_hit, len(result.text))
                p.tool_calls += 1
            p.last_tool_failed = not result.ok
            self._append_result(st, p, result.text, event)

    def _run_calls(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Results of ``calls``, at most ``tool_workers`` running at a time, each timed out ``tool_timeout_s``
        after its own start (time spent waiting for a worker does not count).

        A timed-out call is abandoned: its slot goes to the next call at once while its thread finishes (or
        hangs) on its own, so a hung tool cannot stall the round.  A call that has not even started
        ``tool_timeout_s`` after it was handed to the pool (every thread held by abandoned calls) times out too.
        """
        results: list[ToolResult | None] = [None] * len(calls)
        starts: dict[int, float] = {}  # call index → monotonic start, written by the worker thread
        pending = deque(range(len(calls)))
        running: dict[Future[ToolResult], tuple[int, float]] = {}  # → (call index, when handed to the pool)

        def deadline(i: int, handed: float) -> float:
            return starts.get(i, handed) + self.tool_timeout_s

        while pending or running:
            # A slot per live call, shared with the batches of other questions in flight (rollout.scheduling:
            # per_question); with none running here, wait for one (the wait does not count against the call).
            while pending and self._slots.acquire(blocking=not running):
                i = pending.popleft()
                running[self._pool.submit(self._started_call, calls[i], starts, i)] = (i, time.monotonic())
            first = min(deadline(*entry) for entry in running.values())
            done, _ = wait(running, timeout=max(0.0, first - time.monotonic()), return_when=FIRST_COMPLETED)
            for fut in done:
                results[running.pop(fut)[0]] = fut.result()
                self._slots.release()
            now = time.monotonic()
            for fut, (i, handed) in list(running.items()):
                if now >= deadline(i, handed):
                    fut.cancel()  # only a call that has not started can be cancelled; a running one is abandoned
                    del running[fut]
                    self._slots.release()
                    results[i] = self._timed_out(calls[i])
        return [r for r in results if r is not None]

    def _timed_out(self, call: ToolCall) -> ToolResult:
        """The result of a call that ran past ``tool_timeout_s``: a failed result, like any tool error."""
        return ToolResult(f"Tool {call.name} timed out after {self.tool_timeout_s:.0f} s.", ok=False,
                          error="timeout", latency_s=self.tool_timeout_s)

    def _started_call(self, call: ToolCall, starts: dict[int, float], index: int) -> ToolResult:
        """:meth:`_call_tool`, noting when it started (the start of its timeout)."""
        starts[index] = time.monotonic()
        return self._call_tool(call)

    def _call_tool(self, call: ToolCall) -> ToolResult:
        t0 = time.perf_counter()
        try:
            res = self.tools[call.name](call.argument)
        except Exception as exc:  # a tool that breaks its contract still only produces a result
            res = ToolResult(f"Tool {call.name} failed: {type(exc).__name__}: {exc}", ok=False, error="exception")
        if not res.latency_s:
            res = ToolResult(res.text, res.ok, res.error, time.perf_counter() - t0, res.cache_hit, res.meta)
        return res

    def _append_result(self, st: _QuestionState, p: _Path, text: str, event: ToolEvent) -> None:
        cfg = self.cfg
        block = result_block(text, cfg.max_result_chars)
        ids = self.engine.encode(block)
        remaining = cfg.max_response_tokens - p.response_len
        parent = st.nodes[p.node_ids[-1]]
        node = Node(
            node_id=len(st.nodes),
            parent_id=parent.node_id,
            depth=parent.depth + 1,
            kind="tool",
            token_ids=ids[:remaining],
            token_start=parent.token_end,
            text=block if len(ids) <= remaining else self.engine.decode(ids[:remaining]),
            tool=event,
        )
        st.nodes.append(node)
        p.node_ids.append(node.node_id)
        p.response_len += len(node.token_ids)
        if p.response_len >= cfg.max_response_tokens:
            self._close(p, "tool_error" if p.last_tool_failed else "truncated")
        elif not event.is_notice:  # a notice is no tool feedback: no branch decision, no fork point
            p.after_tool = True
            st.fork_points[node.node_id] = replace(p, node_ids=list(p.node_ids), step_history=list(p.step_history))

    def _close(self, p: _Path, status: LeafStatus) -> None:
        p.status = status
        p.wall_s = time.perf_counter() - p.started

    # ------------------------------------------------------------------ budget
    def _premonitor(self, st: _QuestionState) -> None:
        """m from the probe's entropies under ``budget_rule`` (H_root and H̄_tool are what the tree records)."""
        cfg = self.cfg
        model_nodes = [st.nodes[i] for i in st.probe.node_ids if st.nodes[i].kind == "model"]
        first = model_nodes[0].segment_entropy if model_nodes else math.nan
        post_tool = [n.segment_entropy for n in model_nodes if is_tool_step(st.nodes, n)]
        if cfg.budget_rule == "official":
            # a failed root sample (engine error): the probe's first segment stands in
            root = first if math.isnan(st.root_sample_entropy) else st.root_sample_entropy
            st.h_root, st.h_tool = root, official_tool_entropy(first, post_tool)
            h_root = 0.0 if math.isnan(st.h_root) else st.h_root
            st.m = official_global_budget(cfg.k, h_root, h_root if math.isnan(st.h_tool) else st.h_tool, cfg.beta)
            return
        st.h_root = first
        h_root = st.h_root if not math.isnan(st.h_root) else 0.0
        st.h_tool = mean_tool_entropy(h_root, post_tool)
        st.m = global_budget(cfg.k, h_root, st.h_tool, cfg.beta)

    def _sample_roots(self, states: list[_QuestionState], sampling: SamplingParams) -> None:
        """budget_rule official: H_root of each question from a separate sample of at most ``root_sample_tokens``
        tokens from the prompt that stops at the tool tags, as the published code samples it, scored on its first
        W tokens (:meth:`_segment_entropy`); its tokens are paid and not kept.  A failed sample: NaN."""
        requests = [GenerationRequest(list(st.question.prompt_ids), self.cfg.root_sample_tokens, STOP_STRINGS,
                                      seed=derive_seed(self._seed, st.key, "root")) for st in states]
        for st, res in zip(states, self._engine_generate(requests, sampling), strict=True):
            failed = res.finish_reason == "error" or res.error is not None
            st.root_sample_entropy = math.nan if failed else self._segment_entropy(res)

    def _finish(self, st: _QuestionState) -> RolloutTree:
        if math.isnan(st.h_root) and st.paths:
            first = [st.nodes[i] for i in st.paths[0].node_ids if st.nodes[i].kind == "model"]
            st.h_root = first[0].segment_entropy if first else math.nan
            post = [n.segment_entropy for n in st.nodes if is_tool_step(st.nodes, n)]
            st.h_tool = mean_tool_entropy(st.h_root, post) if not math.isnan(st.h_root) else math.nan
        leaves = []
        for p in st.paths:
            assert p.status is not None, "every path ends with a status"
            branch_steps = sum(p.step_history)
            leaves.append(Leaf(p.leaf_id, list(p.node_ids), p.kind, p.status, branch_steps, p.wall_s))
        return RolloutTree(st.question.question_id, list(st.question.prompt_ids), st.nodes, leaves, st.m,
                           st.h_root, st.h_tool)
