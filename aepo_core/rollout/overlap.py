"""Rollouts whose questions do not wait for each other's tools (``rollout.scheduling: per_question``, issue 56 §2).

The round-synchronous loop (:class:`~aepo_core.rollout.scheduler.RolloutScheduler`) generates a segment for every
active path of every question, then runs the round's tool calls, so every round waits for the slowest call of the
whole batch while the engine idles. Here each question keeps its own rounds: its tool calls run in the background
while the engine generates for the questions whose results are back, and a question whose calls have all returned
joins the next generate call. A question's own events (segments, tool results, branch decisions, fills) happen in
the same order as in the round loop, so its tree is the same for an engine whose samples do not depend on their
batch (the scripted engine of the tests; the in-process engine in float32 up to kernel rounding).

Paths of one question still advance together: a branch decision reads the question's budget as the decisions before
it left it, in path order, so a path's decision waits for the earlier paths' steps of its round (the next step,
paths that advance on their own with decisions in a canonical order, is issue 56's).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from aepo_core.interfaces import SamplingParams, ToolResult
from aepo_core.rollout.scheduler import RolloutScheduler, ToolJob, _QuestionState


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


def scheduler_class(scheduling: str) -> type[RolloutScheduler]:
    """The scheduler ``rollout.scheduling`` names."""
    return PerQuestionScheduler if scheduling == "per_question" else RolloutScheduler
