"""``aepo compare``: a sweep's arms over seeds and their seed-matched paired differences (the ``aepo-compare`` flow,
:mod:`infra.run.compare`), printed as tables, CSV or JSON, and logged to the sweep's parent MLflow run."""

from __future__ import annotations

import enum
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import (
    FormatOpt,
    RunsOpt,
    TrackingOpt,
    choice,
    choices,
    exits,
    reading_tracking_uri,
    resolve_runs_dir,
)
from flows.cli.render import (
    OutputFormat,
    err,
    fail,
    fmt,
    interval,
    out,
    plain_records,
    print_records,
    ui_hint,
    where_table,
)

if TYPE_CHECKING:
    from infra.run.compare import AlgorithmComparison, ArmResult, PairResult


class CompareTable(str, enum.Enum):
    """Which of the comparison's tables ``--format csv`` prints (JSON holds them all)."""

    arms = "arms"
    runs = "runs"
    pairs = "pairs"
    curves = "curves"


def compare_cmd(
    sweep: Annotated[str | None, typer.Argument(help="The sweep: its file (.yaml), its parent run id or its name.",
                                                show_default=False)] = None,
    run: Annotated[list[str] | None, typer.Option("--run", "-r", metavar="RUN_ID",
                                                  help="Compare these runs instead of a sweep (repeatable; the arm "
                                                       "from the sweep_cell tag, else the algorithm tag).")] = None,
    arm: Annotated[list[str] | None, typer.Option("--arm", "-a", help="Only these arms, in this order "
                                                  "(repeatable; default: all).")] = None,
    seed: Annotated[list[int] | None, typer.Option("--seed", help="Only these seeds (repeatable).")] = None,
    dataset: Annotated[str | None, typer.Option("--dataset", "-d", help="Evaluation dataset (default: the first "
                                                "every run evaluated).")] = None,
    baseline: Annotated[str, typer.Option("--baseline", help="The arm each arm is compared with per question.")
                        ] = "grpo",
    table: Annotated[CompareTable, typer.Option("--table", parser=choice(CompareTable), metavar=choices(CompareTable),
                                                help="With --format csv: which table.")
                     ] = CompareTable.arms,
    no_log: Annotated[bool, typer.Option("--no-log", help="Do not log the tables and figures to the sweep's parent "
                                         "MLflow run.")] = False,
    runs_dir: RunsOpt = None,
    tracking_uri: TrackingOpt = None,
    output: FormatOpt = OutputFormat.table,
) -> None:
    """Compare a sweep's arms over seeds: Pass@1 and Pass@k with intervals over seeds and over questions,
    seed-matched paired differences with t-test p-values (Holm over the pairs), entropy slopes, what the mechanisms
    acted on, curves against steps and generated tokens.

    \b
    Examples:
      aepo compare claims-powered                       # a sweep by name (or its file, or its parent run id)
      aepo compare claims-powered -a aepo -a arpo -a grpo --format json > comparison.json
      aepo compare --run 1f0c… --run 9ab2…               # any finished runs
    """
    if (sweep is None) == (not run):
        fail("name a sweep (its file, parent run id or name) or give --run RUN_ID, not both")
    if output is not OutputFormat.csv and table is not CompareTable.arms:
        fail("--table picks the CSV table; with --format table or json every table is printed")
    runs = resolve_runs_dir(runs_dir)
    uri = reading_tracking_uri(runs, tracking_uri)
    assert uri is not None
    from infra.run.compare import find_runs

    exits(find_runs)(uri, sweep, run or [], arm, seed)  # before anything is created: a mistake exits 2 here
    prepare_environment(runs)
    from flows.compare import compare
    from tasks.retry import USER_ERRORS

    start_prefect_api()
    try:
        result = compare(sweep=sweep, run_ids=run, runs_dir=str(runs), tracking_uri=uri, dataset=dataset, arms=arm,
                         seeds=seed, baseline=baseline, log_to_parent=not no_log)
    except USER_ERRORS as exc:
        fail(str(exc))
    except Exception as exc:
        fail(f"comparison failed: {exc}", code=1)
    print_comparison(result.comparison, output, table)
    console = out() if output is OutputFormat.table else err()
    console.print(where_table([("figures", f) for f in result.figures]
                              + ([("MLflow run", f"{result.logged_to} ({', '.join(result.artifacts)})")]
                                 if result.logged_to else [])))
    console.print(escape(ui_hint(uri, runs)))


# ---------------------------------------------------------------------------------------------- printing
def print_comparison(c: AlgorithmComparison, output: OutputFormat, table: CompareTable = CompareTable.arms) -> None:
    """The comparison on stdout: its tables for a person, one CSV table, or one JSON document of them all
    (identifier keys, numbers as numbers)."""
    if output is OutputFormat.json:
        doc: dict[str, Any] = {"dataset": c.dataset, "k": c.k, "baseline": c.baseline,
                               "parent_run_id": c.parent_run_id, "sweep": c.sweep_name}
        for name, rows in (("arms", c.arm_records()), ("runs", c.run_records()), ("pairs", c.pair_records()),
                           ("curves", c.curve_records())):
            doc[name] = plain_records(rows)
        sys.stdout.write(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        return
    if output is OutputFormat.csv:
        rows = {CompareTable.arms: c.arm_records, CompareTable.runs: c.run_records, CompareTable.pairs: c.pair_records,
                CompareTable.curves: c.curve_records}[table]()
        print_records("", rows, output)
        return
    over = f"{c.sweep_name or 'runs'} on {c.dataset}"
    print_records(f"Arms over seeds, {over} (Pass@1: mean and Student-t 95% CI over seeds; over questions: "
                  "bootstrap 95% CI, seeds averaged)", [_arm_row(c, a) for a in c.arms], output,
                  right=("seeds",), fold=("Pass@1 per seed",))
    activity = _activity_rows(c)
    if len(activity[0]) > 1:
        print_records("What the mechanisms acted on (each run's mean over its steps; mean and Student-t 95% CI over "
                      "seeds)", activity, output)
    if c.pairs:
        print_records("Paired differences a − b, seed-matched (over seeds: Student t, p Holm-adjusted over the pairs; "
                      "given seeds: bootstrap over questions)", [_pair_row(p) for p in c.pairs], output,
                      right=("seeds", "p", "p Holm", "seeds a > b"))
    families = [{"a − b": p.name, "family": f, "seeds": d.seeds,
                 "Δ Pass@1 per seed": " ".join(f"{v:+.3f}" for v in d.per_seed.values()),
                 "Δ Pass@1 [CI over seeds]": interval(d.mean, d.low, d.high, signed=True)}
                for p in c.pairs for f, d in p.by_family.items()]
    if families:
        print_records("Paired differences by question family (exploratory: no correction)", families, output)
    print_records("Over training (mean over seeds, first → last RL step)", [_curve_row(a) for a in c.arms], output)


def _arm_row(c: AlgorithmComparison, a: ArmResult) -> dict[str, str]:
    from infra.run.compare import TREND_WORDS

    p, s, t, vs = a.pass1_over_seeds, a.entropy_slope, a.generated_tokens, a.vs_baseline
    return {"arm": a.name, "seeds": str(p.seeds), "Pass@1 per seed": " ".join(f"{v:.3f}" for v in p.per_seed.values()),
            "Pass@1 [CI over seeds]": interval(p.mean, p.low, p.high),
            "Pass@1 [CI over questions]": interval(a.pass1.value, a.pass1.low, a.pass1.high),
            f"Pass@{c.k} [CI]": interval(a.pass_k.value, a.pass_k.low, a.pass_k.high),
            f"Δ vs {c.baseline} [CI]": "–" if vs is None else interval(vs.diff, vs.ci_low, vs.ci_high, signed=True),
            "tokens/run": "–" if t is None else f"{t.mean:,.0f}", "tool calls/q": fmt(a.tool_calls_per_question, 2),
            "entropy slope/step [CI]": "–" if s is None else interval(s.mean, s.low, s.high, 4, signed=True),
            "entropy trend": "–" if s is None else TREND_WORDS[s.sign]}


def _activity_rows(c: AlgorithmComparison) -> list[dict[str, str]]:
    """Per arm, what its mechanisms acted on (:data:`~infra.run.compare.ACTIVITY`, the metrics some arm logged):
    each run's mean over its steps, then the mean over seeds with its interval; shares in per cent."""
    from infra.run.compare import ACTIVITY, PERCENT

    logged = [m for m in ACTIVITY if any(m in a.activity for a in c.arms)]

    def cell(a: ArmResult, metric: str) -> str:
        o = a.activity.get(metric)
        if o is None:
            return "–"
        if metric in PERCENT:
            return interval(*(None if x is None else 100 * x for x in (o.mean, o.low, o.high)), 2)
        return interval(o.mean, o.low, o.high)

    return [{"arm": a.name, **{f"{ACTIVITY[m]}{' %' if m in PERCENT else ''}": cell(a, m) for m in logged}}
            for a in c.arms]


def _pair_row(p: PairResult) -> dict[str, str]:
    g, e = p.pass1_given_seeds, p.entropy_slope
    return {"a − b": p.name, "seeds": str(p.pass1.seeds),
            "Δ Pass@1 [CI over seeds]": interval(p.pass1.mean, p.pass1.low, p.pass1.high, signed=True),
            "p": fmt(p.p_over_seeds), "p Holm": fmt(p.p_holm),
            "Δ Pass@1 [CI given seeds]": interval(g["diff"], g["ci_low"], g["ci_high"], signed=True),
            "seeds a > b": f"{int(g['positive'])}/{p.pass1.seeds}",
            "Δ entropy slope/step [CI]": "–" if e is None else interval(e.mean, e.low, e.high, 4, signed=True)}


def _curve_row(a: ArmResult) -> dict[str, str]:
    from infra.run.compare import CURVE_METRICS

    def first_to_last(metric: str) -> str:
        band = a.curves.get(metric, [])
        return f"{band[0][1]:.3g} → {band[-1][1]:.3g}" if band else "–"

    return {"arm": a.name, **{metric.split("/")[-1]: first_to_last(metric) for metric in CURVE_METRICS}}
