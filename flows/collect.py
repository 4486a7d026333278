"""A step's rollouts: sampled in turn (on-policy) or ahead of the update that trains on them (bounded staleness).

:func:`collect` samples and scores rounds of the data order's next questions until the batch is full of informative
groups (one round without dynamic sampling). On-policy, the train flow calls it between two updates. Under
``train.max_staleness`` = s > 0, :class:`RolloutsAhead` submits it as a Prefect task (the flow's thread pool) for
the steps the trainer's current weights are due to sample (:func:`aepo_core.staleness.due_steps`), so the rollouts
of the next steps run while the current update trains. One sampler runs one rollout at a time: each submitted
rollout waits for the one before it (``wait_for``), and new weights are handed to the engine only when it is idle.
Which weights sample which step is fixed by the config (:mod:`aepo_core.staleness`), never by timing, and no rollout
is in flight at a checkpoint, so a run killed and resumed samples what the uninterrupted run samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from aepo_core.dynamic_sampling import FilledBatch, InformativeBatch, max_rounds
from aepo_core.rollout.scheduler import merge_results
from aepo_core.staleness import due_steps
from infra.run.session import RunSession
from tasks.rl import rollout, score


@dataclass(frozen=True)
class Collected:
    """A step's filled batch and what sampling it took: ``wall_s`` from its first round's start to its last score,
    ``cpu_s`` the process's CPU seconds meanwhile (under overlap they include the concurrent update's)."""

    batch: FilledBatch
    wall_s: float
    cpu_s: float


def collect(session: RunSession, step: int, timed: bool = True) -> Collected:
    """Sample and score the step's questions until the batch is full of informative groups: every rank rolls out
    its shard, then all see the whole step, in question order. The data cursor advances by the rounds drawn.
    ``timed``: each rollout task runs under ``train.rollout_timeout_s`` (Prefect enforces it on the flow's own
    thread only; a submitted collect is bounded where it is taken, :meth:`RolloutsAhead.take`)."""
    runtime, trainer, ranks, cfg = session.runtime, session.trainer, session.trainer.ranks, session.cfg
    t0, cpu0 = time.perf_counter(), runtime.cpu_seconds()
    batch = InformativeBatch(cfg.train.batch_size, cfg.algorithm)
    sample = rollout.with_options(timeout_seconds=cfg.train.rollout_timeout_s if timed else None,
                                  retries=cfg.train.task_retries)
    while batch.wants_more():
        rows = trainer.next_batch()
        result = merge_results(ranks.all_gather(sample(runtime, ranks.shard(rows), step, batch.tries, ranks.rank)))
        batch.add(result, score(runtime, result, rows, step))
    return Collected(batch.filled(), time.perf_counter() - t0, runtime.cpu_seconds() - cpu0)


@task(name="collect", task_run_name="collect-step-{step}", cache_policy=NO_CACHE, retries=0)
def collect_ahead(session: RunSession, step: int) -> Collected:
    """:func:`collect` as a task the flow submits (its rollouts retry as they do in turn)."""
    return collect(session, step, timed=False)


class RolloutsAhead:
    """The submitted rollouts of the steps not yet trained on, under ``train.max_staleness`` > 0."""

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self._pending: dict[int, PrefectFuture[Collected]] = {}
        self._last: PrefectFuture[Collected] | None = None

    def take(self, step: int) -> Collected:
        """The rollouts of ``step``, the next to train: first the rollouts the trainer's current weights are due
        to sample are submitted (they run during this step's update), then this step's are waited for, at most
        ``train.rollout_timeout_s`` for each of its rounds and their retries (a :class:`TimeoutError` then fails
        the run, which resumes from its last checkpoint)."""
        self._submit_due()
        if step not in self._pending:
            raise RuntimeError(f"the rollouts of step {step} were never started: the trainer is at step "
                               f"{self.session.trainer.step}, which is not a checkpoint step of this run's schedule")
        t = self.session.cfg.train
        bound = t.rollout_timeout_s * (t.task_retries + 1) * max_rounds(self.session.cfg.algorithm)
        try:
            return self._pending.pop(step).result(timeout=bound)
        except TimeoutError:
            raise TimeoutError(f"the rollouts of step {step} took over {bound:.0f} s (train.rollout_timeout_s "
                               f"{t.rollout_timeout_s:.0f} s per round and retry)") from None

    def hand_over(self) -> None:
        """Wait until the engine is idle and give it the trainer's current weights (before an evaluation, which
        samples from the engine; the next submitted rollout takes its own weights again)."""
        self._drain()
        self.session.runtime.weights_changed(self.session.trainer.weights())

    def _submit_due(self) -> None:
        cfg, trainer = self.session.cfg, self.session.trainer
        due = [j for j in due_steps(trainer.step, trainer.total_steps, cfg.train.max_staleness, cfg.checkpoint.every)
               if j not in self._pending]
        if not due:
            return
        self.hand_over()  # the engine samples the due steps from the weights of trainer.step updates
        for step in due:
            self._last = collect_ahead.submit(quote(self.session), step,
                                              wait_for=[self._last] if self._last is not None else None)
            self._pending[step] = self._last

    def _drain(self) -> None:
        """Wait for the rollout in flight, if any (its failure surfaces when its step is taken)."""
        if self._last is not None:
            self._last.wait()
