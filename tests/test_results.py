"""Every number the docs quote from a benchmark is the number in its committed results, and every results folder
records the command and the commit that produced it (benchmarks/report.py, benchmarks/provenance.py)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_the_docs_quote_the_results_as_they_are():
    found = report.differences()
    assert not found, "Run `python benchmarks/report.py` (or fix the results):\n" + "".join(found)


def test_a_changed_number_in_a_doc_fails_the_check():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = report.BLOCK.search(text)
    value = report.VALUE.search(text)
    assert block and value, "docs/benchmarks.md quotes its tables and numbers through markers"
    for match in (block, value):
        body = match["body"]
        digit = re.search(r"\d", body)
        changed = body[: digit.start()] + str((int(digit[0]) + 1) % 10) + body[digit.end() :]
        edited = text[: match.start("body")] + changed + text[match.end("body") :]
        assert report.render(edited) == text  # the quote is rewritten from the results: the edit shows as a diff
    with pytest.raises(KeyError, match="no-such-result"):
        report.render("<!-- value: no-such-result -->1<!-- /value -->")


def test_no_line_starts_with_a_quoted_value():
    # In Markdown a line that starts with an HTML comment starts a raw HTML block: the sentence would break there.
    for path in report.DOCS:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            assert not line.lstrip().startswith("<!-- value:"), f"{path.name}:{number}: move a word before the marker"


def test_every_quote_names_a_result_and_every_result_is_read():
    quoted = {m["name"] for path in report.DOCS for pattern in (report.BLOCK, report.VALUE)
              for m in pattern.finditer(path.read_text())}  # fmt: skip
    assert quoted <= set(report.QUOTES)
    report.READ.clear()
    for path in report.DOCS:
        report.render(path.read_text())
    assert report.READ == {path.name for path in RESULTS.iterdir() if path.is_dir()}  # no folder the docs ignore


def is_shallow() -> bool:
    return subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() == "true"  # fmt: skip


@pytest.mark.parametrize("folder", sorted(p.name for p in RESULTS.iterdir() if p.is_dir()))
def test_every_results_folder_records_its_command_and_commit(folder):
    runs = json.loads((RESULTS / folder / "provenance.json").read_text())["runs"]
    assert runs
    for run in runs:
        command = re.sub(r"^timeout \d+ ", "", run["command"])  # gpu.sh gives each part a time limit
        assert command.startswith(("python ", "bash ")) or "=" in command.split()[0], run["command"]
        assert re.fullmatch(r"[0-9a-f]{40}", run["commit"]), run
        if "recorded_afterwards" in run:  # an old result: the docs name its commit beside its numbers
            docs = "".join(path.read_text() for path in report.DOCS)
            assert f"<!-- value: {folder}.commit -->" in docs, folder
        else:
            assert run["dirty"] is False, f"{folder} was produced by uncommitted code"
            assert run["seconds"] > 0 and run["machine"]["cpu"] and run["machine"]["cores"] >= 1
            assert {"torch", "transformers", "trl", "peft"} <= set(run["versions"])
    if not (ROOT / ".git").exists() or is_shallow():
        pytest.skip("the commits are checked against the git history in a full clone (this one has none)")
    for run in runs:
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", run["commit"], "HEAD"], cwd=ROOT)
        assert ancestor.returncode == 0, f"{folder}: {run['commit']} is not in this branch's history"
