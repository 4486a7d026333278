"""Rollouts that do not wait on each other's tools (``rollout.scheduling`` per_question, per_path; issue 56 §2).

The round-synchronous loop (:class:`~aepo_core.rollout.scheduler.RolloutScheduler`) generates a segment for every
active path of every question, then runs the round's tool calls, so every round waits for the slowest call of the
whole batch while the engine idles. Here each question keeps its own rounds: its tool calls run in the background
while the engine generates for the questions whose results are back, and a question whose calls have all returned
joins the next generate call. A question's own events (segments, tool results, branch decisions, fills) happen in
the same order as in the round loop, so its tree is the same for an engine whose samples do not depend on their
batch (the scripted engine of the tests; the in-process engine in float32 up to kernel rounding).

:class:`PerPathScheduler` goes further: each path advances on its own, and only the branch decisions keep the round
loop's order. With ``rollout.inflight_requests`` each ready path's segment is a request of its own, sent the moment
the path is ready, many in flight: a server engine batches them itself (vLLM's continuous batching), the in-process
engine lets each join the batch it is decoding at its next token. Without it the ready paths are one generate call,
and a path that becomes ready meanwhile waits for that call to end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace

from aepo_core.interfaces import GenerationResult, SamplingParams, ToolResult
from aepo_core.protocol import ToolCall
from aepo_core.rollout.scheduler import (
    TOOL_THREAD_HEADROOM,
    Question,
    RolloutResult,
    RolloutScheduler,
    ToolJob,
    _Path,
    _QuestionState,
)
from aepo_core.rollout.tree import Node, RolloutTree, SampleKind, ToolEvent


class PerQuestionScheduler(RolloutScheduler):
    """:class:`RolloutScheduler` with a question's tool calls overlapped with the other questions' generation.

    Timers: ``generate_s`` is the engine's time as before; ``tools_s`` is the time the loop waited on tools with
    nothing to generate (in the round loop every call's wait counts: there the engine always waits)."""

    def _run_rounds(self, states: list[_QuestionState], sampling: SamplingParams) -> None:
        branching = self.cfg.mode != "independent"
        waiting: dict[Future[list[ToolResult]], tuple[_QuestionState, list[ToolJob]]] = {}
        order = {st.key: i for i, st in enumerate(states)}
        with ThreadPoolExecutor(max_workers=max(1, len(states)), thread_name_prefix="aepo-question") as batches:
            while True:
                out = {st.key for st, _ in waiting.values()}
                for st in states:
                    while st.key not in out and not any(p.status is None for p in st.paths) and self._advance(st):
                        pass
                ready = [(st, p) for st in states if st.key not in out for p in st.paths if p.status is None]
                if not ready and not waiting:
                    return
                if ready:
                    jobs: dict[str, tuple[_QuestionState, list[ToolJob]]] = {}
                    for (st, p), res in zip(ready, self._generate(states, ready, sampling), strict=True):
                        job = self._absorb_segment(st, p, res, branching and not st.probing)
                        if job is not None:
                            jobs.setdefault(st.key, (st, []))[1].append((st, p, *job))
                    for st, question_jobs in jobs.values():
                        waiting[batches.submit(self._tool_results, question_jobs)] = (st, question_jobs)
                t0 = time.perf_counter()
                done, _ = wait(waiting, timeout=0 if ready else None, return_when=FIRST_COMPLETED)
                if not ready:
                    self._timers["tools_s"] += time.perf_counter() - t0
                for fut in sorted(done, key=lambda f: order[waiting[f][0].key]):
                    _, question_jobs = waiting.pop(fut)
                    self._apply_tool_results(question_jobs, fut.result())


class PerPathScheduler(RolloutScheduler):
    """Paths that advance on their own (``rollout.scheduling: per_path``): a path whose tool result is back generates
    its next segment at once, whatever its question's other paths are doing.

    What a path samples depends only on its own state (its segment seeds come from its identity), so only the branch
    decisions need an order: they read the budget that the decisions before them left. Each path keeps a logical
    round (the round loop's: a global or fill starts at its question's next round, a fork at the round after its
    decision, each segment one round further), and a question's decisions are taken in (round, path) order, each once
    every path that could come before it has reached its round (:meth:`_ready`); until then the path generates on and
    only its forks wait. The nodes are numbered in the round loop's order at the end (:meth:`_finish`), so the tree is
    the round loop's wherever the engine's samples do not depend on their batch.
    """

    def run(self, questions: Sequence[Question], seed: int, sampling: SamplingParams | None = None) -> RolloutResult:
        self._start: dict[int, int] = {}  # id(path) → the logical round of its first segment less its segments then
        self._clock: dict[str, int] = {}  # question → the round after its latest absorbed segment
        self._pending: dict[str, list[tuple[int, int, _Path, Node]]] = {}  # question → (round, path index, …)
        self._order: dict[str, list[tuple[int, int, int]]] = {}  # question → each node's (round, phase, path index)
        self._deciding = 0
        return super().run(questions, seed, sampling)

    # -- logical time
    def _round(self, p: _Path) -> int:
        """The logical round of the path's next segment."""
        return self._start[id(p)] + p.segments

    def _new_path(self, st: _QuestionState, kind: SampleKind, key: str | None = None) -> _Path:
        path = super()._new_path(st, kind, key)
        self._start[id(path)] = self._clock.get(st.key, 0)
        return path

    def _fork(self, st: _QuestionState, tool_node: int, history: list[bool], branch: int) -> _Path:
        path = super()._fork(st, tool_node, history, branch)
        self._start[id(path)] = self._deciding + 1 - path.segments  # it carries its parent's segment count
        return path

    def _advance(self, st: _QuestionState) -> bool:
        advanced = super()._advance(st)
        del self._order.setdefault(st.key, [])[len(st.nodes):]  # a rewind to the prompt drops the probe's nodes
        return advanced

    # -- nodes in the round loop's order
    def _absorb_segment(self, st: _QuestionState, p: _Path, res: GenerationResult,
                        branching: bool) -> tuple[ToolCall | None, str | None] | None:
        r, index, before = self._round(p), st.paths.index(p), len(st.nodes)
        job = super()._absorb_segment(st, p, res, branching)
        if len(st.nodes) > before:
            self._note(st, before, (r, 0, index))
        self._clock[st.key] = max(self._clock.get(st.key, 0), r + 1)
        return job

    def _append_result(self, st: _QuestionState, p: _Path, text: str, event: ToolEvent) -> None:
        before = len(st.nodes)
        super()._append_result(st, p, text, event)
        if len(st.nodes) > before:
            self._note(st, before, (self._round(p) - 1, 1, st.paths.index(p)))

    def _note(self, st: _QuestionState, node_id: int, key: tuple[int, int, int]) -> None:
        order = self._order.setdefault(st.key, [])
        order.extend([(-1, -1, -1)] * (node_id + 1 - len(order)))  # the prompt, node 0
        order[node_id] = key

    def _finish(self, st: _QuestionState) -> RolloutTree:
        """The tree with its nodes renumbered in the round loop's order: by round, a round's segments before its
        tool results, each in path order."""
        order = self._order.get(st.key, [])
        order += [(-1, -1, -1)] * (len(st.nodes) - len(order))
        ranked = sorted(range(len(st.nodes)), key=lambda i: (order[i], i))
        new_id = {old: new for new, old in enumerate(ranked)}
        st.nodes = [replace(st.nodes[old], node_id=new,
                            parent_id=None if st.nodes[old].parent_id is None else new_id[st.nodes[old].parent_id])
                    for new, old in enumerate(ranked)]
        for p in st.paths:
            p.node_ids = [new_id[i] for i in p.node_ids]
        return super()._finish(st)

    # -- decisions in (round, path) order
    def _decide(self, st: _QuestionState, p: _Path, node: Node, budget_left: int) -> None:
        """Queue the decision; :meth:`_settle` takes it in its turn."""
        self._pending.setdefault(st.key, []).append((self._round(p) - 1, st.paths.index(p), p, node))

    def _ready(self, st: _QuestionState, r: int, index: int) -> bool:
        """Whether every path that comes before (round r, path ``index``) has got there: an active path before it in
        path order has absorbed its round-r segment, one after it its round-(r − 1) segment."""
        return all(p.status is not None or self._round(p) >= (r + 1 if j < index else r)
                   for j, p in enumerate(st.paths) if j != index)

    def _settle(self, st: _QuestionState) -> None:
        queue = self._pending.get(st.key, [])
        queue.sort(key=lambda d: (d[0], d[1]))
        while queue and self._ready(st, queue[0][0], queue[0][1]):
            r, _, p, node = queue.pop(0)
            self._deciding = r
            RolloutScheduler._decide(self, st, p, node, budget_left=self.cfg.k - st.leaves_started)

    # -- the loop
    def _run_rounds(self, states: list[_QuestionState], sampling: SamplingParams) -> None:
        """Generate for the ready paths, run their tool calls in the background, take each result as it comes.
        With ``rollout.inflight_requests`` each ready path's segment is its own request in flight (the engine
        batches them), else the ready paths are one generate call. Only the requests run in threads: every change
        of a tree happens here, in the order events are taken, which changes nothing but node numbers (renumbered
        at the end) and is why decisions are queued (:meth:`_settle`)."""
        branching = self.cfg.mode != "independent"
        waiting: dict[Future[object], tuple[_QuestionState, _Path, ToolJob | None]] = {}  # job None: a segment
        out: set[int] = set()  # id(path) of the paths whose segment or tool call is out
        per_request = self.cfg.inflight_requests
        with ThreadPoolExecutor(max_workers=TOOL_THREAD_HEADROOM * self.tool_workers,
                                thread_name_prefix="aepo-path") as calls, \
                ThreadPoolExecutor(max_workers=max(1, per_request), thread_name_prefix="aepo-request") as requests:
            def take_segment(st: _QuestionState, p: _Path, res: GenerationResult) -> None:
                job = self._absorb_segment(st, p, res, branching and not st.probing)
                if job is not None:
                    waiting[calls.submit(self._tool_results, [(st, p, *job)])] = (st, p, (st, p, *job))
                    out.add(id(p))

            while True:
                for st in states:
                    self._settle(st)
                    while not self._pending.get(st.key) and not any(p.status is None for p in st.paths) \
                            and self._advance(st):
                        pass
                ready = [(st, p) for st in states for p in st.paths if p.status is None and id(p) not in out]
                if not ready and not waiting:
                    return
                if ready and per_request:
                    for st, p in ready:
                        waiting[requests.submit(self._generate, states, [(st, p)], sampling)] = (st, p, None)
                        out.add(id(p))
                    ready = []
                elif ready:
                    for (st, p), res in zip(ready, self._generate(states, ready, sampling), strict=True):
                        take_segment(st, p, res)
                t0 = time.perf_counter()
                done, _ = wait(waiting, timeout=0 if ready else None, return_when=FIRST_COMPLETED)
                if not ready and all(job is not None for _, _, job in waiting.values()):
                    self._timers["tools_s"] += time.perf_counter() - t0  # nothing was generating
                for fut in done:  # any order: an event changes only its own path; nodes are renumbered at the end
                    st, p, job = waiting.pop(fut)
                    out.discard(id(p))
                    if job is None:
                        (res,) = fut.result()  # type: ignore[misc]
                        take_segment(st, p, res)
                    else:
                        self._apply_tool_results([job], fut.result())  # type: ignore[arg-type]


def scheduler_class(scheduling: str) -> type[RolloutScheduler]:
    """The scheduler ``rollout.scheduling`` names."""
    return {"per_question": PerQuestionScheduler, "per_path": PerPathScheduler}.get(scheduling, RolloutScheduler)
