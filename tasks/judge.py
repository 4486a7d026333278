"""judge: an evaluation's final answers through the LLM judge (``eval.judge_url``, see :mod:`infra.judge`)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from infra.judge import LLMJudge, Verdict
from infra.run.evaluation import EvalReport, judge_report


@task(name="judge", task_run_name="judge-{report.key}", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def judge(url: str, model: str | None, report: EvalReport) -> dict[str, list[Verdict]]:
    """Every sample's final answer of ``report`` through the LLM judge: per question, one verdict per sample."""
    judge = LLMJudge(url, model)
    verdicts = judge_report(judge, report)
    counts: dict[str, int] = {}
    for vs in verdicts.values():
        for v in vs:
            counts[v.verdict] = counts.get(v.verdict, 0) + 1
    get_run_logger().info("judge %s on %s: %d answers, %s", judge.url, report.key, sum(counts.values()), counts)
    return verdicts
