"""The CLI's CSV and JSON keys are identifiers a program can use as names (the tables keep their headings)."""

from __future__ import annotations

import json

import pytest

from flows.cli.render import OutputFormat, identifier, print_records


@pytest.mark.parametrize(("heading", "key"), [("run id", "run_id"), ("CPU s", "cpu_s"), ("pass@1", "pass_at_1"),
                                             ("tool calls/leaf", "tool_calls_per_leaf"), ("H_root", "h_root"),
                                             ("branch points", "branch_points"), ("seed", "seed")])
def test_a_heading_becomes_an_identifier(heading: str, key: str) -> None:
    assert identifier(heading) == key


def test_json_and_csv_rows_use_identifier_keys_and_keep_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"run id": "abc", "seed": 0, "pass@1": 0.25, "CPU s": float("nan")}]
    print_records("t", records, OutputFormat.json)
    assert json.loads(capsys.readouterr().out) == [{"run_id": "abc", "seed": 0, "pass_at_1": 0.25, "cpu_s": None}]
    print_records("t", records, OutputFormat.csv)
    assert capsys.readouterr().out.splitlines() == ["run_id,seed,pass_at_1,cpu_s", "abc,0,0.25,"]
