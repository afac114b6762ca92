"""Smoke test of benchmarks/cost.py: it runs and prints a table with ratio columns (its numbers are not checked:
speed and memory are measured by the benchmark itself, side by side, never by timed unit tests)."""

import importlib.util
from pathlib import Path


def test_cost_benchmark_prints_ratio_table(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cost.py"
    spec = importlib.util.spec_from_file_location("cost_benchmark", path)
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    table = cost.main(["--quick", "--steps", "2", "--lengths", "16", "--batches", "2"])
    out = capsys.readouterr().out
    assert table in out
    header, _rule, *rows = table.splitlines()
    for column in ("TOPR/SFT", "TOPR+pre total/SFT total", "TOPR/KTO", "mem TOPR/SFT"):
        assert column in header
    assert len(rows) == 1 and rows[0].startswith("| 16 | 2 |")
    assert len(rows[0].split("|")) == len(header.split("|"))
