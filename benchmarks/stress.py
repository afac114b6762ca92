"""The multi-process tests run again and again with both cores busy: a hang that timing decides shows up here.

Runs README's multi-process tests (`pytest -m "multiprocess and not vllm" tests`: the 2-process launches of the
trainers, the loop, the recipes and the sharded engines, on gloo) `--runs` times in a row, while a CPU burner keeps
every core busy with other work (one spinning process per core, started before the first run and stopped after the
last). Each run has a time limit (`--limit`, seconds); a run past it is a hang: its processes are stopped and it is
recorded as one. Each finished run is a line of `runs.jsonl` in the results folder (committed with it), so a call
stopped midway goes on from there when started again; `results.json` and `table.md` sum up every recorded run.

    python benchmarks/stress.py                    # 10 runs into benchmarks/results/stress
    python benchmarks/stress.py --quick --out DIR  # one run of one fast test (what tests/test_benchmarks.py runs)
"""

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from provenance import ROOT, code_version, save

from trl_topr.testing import kill_tree


MARKER = "multiprocess and not vllm"
QUICK = "every_process_stops"  # the fast 2-process test: the collectives' agreement and errors
KEPT_LINES = 200  # of each run's log
LIMIT_S = 3600  # a run of the multi-process tests took about 20 minutes here with the cores busy (see the results)


def burn() -> None:
    """Keep one core busy until stopped."""
    while True:
        pass


def run_tests(select: str | None, limit_s: float, log: Path) -> dict:
    """One run of the multi-process tests (`select`: a `-k` expression, else all of them): its exit status, seconds,
    pytest's summary line, and whether it ran past `limit_s` (a hang: every process it started is stopped)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", MARKER, "tests"]
    command += ["-k", select] if select else []
    start = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            status, hung = process.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)  # the tests' launches too, in sessions of their own
            status, hung = process.wait(), True
    lines = log.read_text(errors="replace").splitlines()
    log.write_text("\n".join(lines[-KEPT_LINES:]) + "\n")  # what a failure printed last, not every warning
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    return {"exit_status": status, "seconds": round(time.monotonic() - start, 1), "summary": summary, "hung": hung}


def summarize(runs: list[dict]) -> tuple[dict, str]:
    """Totals over the recorded runs, and the table of them."""
    totals = {
        "runs": len(runs),
        "passed_runs": sum(r["exit_status"] == 0 for r in runs),
        "hung_runs": sum(r["hung"] for r in runs),
        "seconds_max": max((r["seconds"] for r in runs), default=0.0),
    }
    rows = ["| run | commit | exit | seconds | hung | pytest |", "|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(
            f"| {r['run']} | {(r['commit'] or '?')[:7]} | {r['exit_status']} | {r['seconds']:.0f} | "
            f"{'yes' if r['hung'] else 'no'} | {r['summary']} |"
        )
    head = (
        f"{totals['passed_runs']} of {totals['runs']} runs passed, {totals['hung_runs']} hung "
        f"(longest {totals['seconds_max']:.0f} s), with {runs[0]['burners'] if runs else 0} cores burned\n\n"
    )
    return totals, head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs in all, recorded ones included (default 10)")
    parser.add_argument("--limit", type=float, default=LIMIT_S, help="seconds a run may take before it is a hang")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stress")
    parser.add_argument("--quick", action="store_true", help=f"one run of one fast test ({QUICK})")
    args = parser.parse_args(argv)
    started = time.time()
    runs_file = args.out / "runs.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    runs = (
        [json.loads(line) for line in runs_file.read_text().splitlines() if line.strip()] if runs_file.exists() else []
    )
    wanted = 1 if args.quick else args.runs
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(os.cpu_count() or 1)]
    for burner in burners:
        burner.start()
    try:
        while len(runs) < wanted:
            number = len(runs) + 1
            print(f"run {number} of {wanted}, {len(burners)} cores busy with other work", flush=True)
            result = run_tests(QUICK if args.quick else None, args.limit, args.out / f"run-{number}.log")
            runs.append({"run": number, **result, "burners": len(burners), "commit": code_version()["commit"]})
            with open(runs_file, "a") as f:
                f.write(json.dumps(runs[-1]) + "\n")
            print(f"  {result['summary'] or 'no summary'} in {result['seconds']:.0f} s, hung: {result['hung']}")
    finally:
        for burner in burners:
            burner.terminate()
            burner.join()
    totals, table = summarize(runs)
    save(
        args.out,
        {"results.json": {"totals": totals, "runs": runs}, "table.md": table},
        script=__file__,
        argv=argv,
        started=started,
        append=True,
    )
    print(table)
    return totals


if __name__ == "__main__":
    main()
