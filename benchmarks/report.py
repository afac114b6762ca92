"""Write the docs' result tables, figures and quoted numbers from the committed results in `benchmarks/results/`.

    python benchmarks/report.py           # rewrite what README.md and docs/*.md quote from the results
    python benchmarks/report.py --check   # exit 1, with a diff, where a doc and its results disagree

A doc quotes a result between markers that name it, and this command writes what is between them:

    <!-- generated: iterative-real.table -->          a block: a table, a list
    ...
    <!-- /generated -->
    ... sampled pass@1 <!-- value: cost.step -->1.00-1.01<!-- /value --> ...     a number in a sentence

Each name is a key of `QUOTES` below, whose entry is data, `(function, *arguments)`, quoted as `function(*arguments)`:
a helper of this module that reads the files of one results folder, mostly its first argument, and plain arguments
that pick what to quote from them. Figures are copied from the results folders to `docs/images/` (`FIGURES`).
`tests/test_results.py` runs the check in the test suite, so a number that changes in the results, or in a doc,
fails it.

To quote another number: write a helper below if none reads it yet (a function of the folder and plain arguments that
returns the text), add one entry `"<folder>.<what>": (helper, "<folder>", ...)` to `QUOTES`, put
`<!-- value: <folder>.<what> --><!-- /value -->` in a doc, and run `python benchmarks/report.py` to fill it in.
"""

import argparse
import difflib
import json
import re
import shutil
import statistics
import sys
from pathlib import Path

import iterative_report
import learning
import memory
import paired as paired_stats
from arms import ARMS
from ledger import Ledger


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.@+-]+) -->)\n(?P<body>.*?)(<!-- /generated -->)", re.S)
VALUE = re.compile(r"(<!-- value: (?P<name>[\w.@+-]+) -->)(?P<body>[^\n]*?)(<!-- /value -->)")
FIGURES = {  # docs/images/<name> <- benchmarks/results/<file>
    "learning-real.png": "learning-real/learning.png",
    "learning-fast.png": "learning-fast-lr1e-4/learning.png",
    "iterative-fast.png": "iterative-fast-8/iterative.png",
    "iterative-easy-before-replay.png": "iterative-easy-before-replay/iterative.png",
    "iterative-real.png": "iterative-real/iterative.png",
    "iterative-real-v2.png": "iterative-real-v2/iterative.png",
}


# -------------------------------------------------------------------------------------------------------- reading
READ: set[str] = set()  # the results folders read so far (every folder should be quoted somewhere)


def load(folder: str, name: str = "results.json"):
    """A result file: parsed where it is JSON, its text otherwise."""
    READ.add(folder)
    text = (RESULTS / folder / name).read_text()
    return json.loads(text) if name.endswith(".json") else text


def records(folder: str) -> list[dict]:
    """The entries of a folder's record (`provenance.json`), one per call, in order."""
    READ.add(folder)
    return json.loads((RESULTS / folder / "provenance.json").read_text())["runs"]


def provenance(folder: str, which: int = -1) -> dict:
    """An entry of a folder's record, by default the last: the command that wrote its results last."""
    return records(folder)[which]


def tables(text: str) -> list[str]:
    """The markdown tables of a text, in order."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append("\n".join(current))
            current = []
    return found


def rows(table: str) -> list[dict[str, str]]:
    """A markdown table's rows as {header: cell}."""
    header, _rule, *lines = table.splitlines()
    names = [cell.strip() for cell in header.strip("|").split("|")]
    return [dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines]


def column(table: str, name: str) -> list[float]:
    return [float(row[name].rstrip("%")) for row in rows(table)]


def span(values: list[float], digits: int = 2) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def met(values: list[float], target: float, at_least: bool = False) -> str:
    """How many of `values` are at most (`at_least`: at least) `target`: "all 4", "2 of 4", "none of 4"."""
    count = sum(value >= target if at_least else value <= target for value in values)
    return f"all {count}" if count == len(values) else f"{count or 'none'} of {len(values)}"


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return " ".join(
        part
        for part in (
            f"{hours} h" * bool(hours),
            f"{minutes} min" * bool(minutes),
            f"{rest} s" * bool(rest or not (hours or minutes)),
        )
        if part
    )


def median_seconds(values: list[float]) -> str:
    """The median of a list of seconds: "0.42 s"."""
    return f"{statistics.median(values):.2f} s"


def machine(folder: str) -> str:
    """The CPU (or GPU) and its bf16-relevant features, from a folder's record: "AMD EPYC, 2 cores (AVX512-BF16, no
    AMX)"."""
    info = provenance(folder)["machine"]
    if info.get("gpu"):
        return info["gpu"]
    flags = info["cpu_flags"]
    if "amx_tile" in flags:
        features = "AMX"
    elif "avx512_bf16" in flags:
        features = "AVX512-BF16, no AMX"
    else:
        features = "AVX512, no bf16" if "avx512f" in flags else "AVX2 only"
    return f"{info['cpu']}, {info['cores']} cores ({features})"


def mean(values) -> float:
    return statistics.fmean(values)


# ------------------------------------------------------------------------------------ one value of a results folder
def run_time(folder: str, which: int = -1) -> str:
    """How long the command of an entry of a folder's record ran: "2 min 28 s"."""
    return duration(provenance(folder, which)["seconds"])


def commit(folder: str, which: int = -1) -> str:
    """The commit an entry of a folder's record ran at, abbreviated: "3f2a9c1"."""
    return provenance(folder, which)["commit"][:7]


def training_commit(folder: str) -> str:
    """The commit the calls that trained a ledger's runs ran at (the records that list `runs`; one, abbreviated), where
    later `--report_only` calls rewrote the tables with newer code."""
    commits = {entry["commit"][:7] for entry in records(folder) if entry.get("runs")}
    if len(commits) != 1:
        raise ValueError(f"{folder}: its runs were trained at {sorted(commits)}, not at one commit")
    return commits.pop()


def tables_commit(folder: str) -> str:
    """The commit of the last `--report_only` call of a folder's record (the code that wrote its tables)."""
    return [entry for entry in records(folder) if "--report_only" in entry["command"]][-1]["commit"][:7]


def command(folder: str) -> str:
    """The command that wrote a folder's results last."""
    return provenance(folder)["command"]


def package_versions(folder: str, names: dict[str, str] | None = None) -> str:
    """The versions of the packages a folder's last run used, as `names` ({package: name to write}) picks and names
    them (all, by default): "vLLM 0.32.0, transformers 5.19.0"."""
    versions = provenance(folder)["versions"]
    return ", ".join(f"{name} {versions[package]}" for package, name in (names or {v: v for v in versions}).items())


def time_limits(folder: str, which: tuple[int, ...]) -> str:
    """The seconds of the entries of a folder's record that ran into their time limit (exit status 124, `timeout`):
    "240 s and 150 s"."""
    runs = [provenance(folder, i) for i in which]
    return " and ".join(f"{run['seconds']:.0f} s" for run in runs if run["exit_status"] == 124)


def result_value(folder: str, keys: str | tuple[str, ...], form="{}", name: str = "results.json") -> str:
    """A value of a JSON result file, at a key or a tuple of nested keys, written by `form`: a format string
    ("{:.2f}") or a function of the value (`duration`)."""
    value = load(folder, name)
    for key in (keys,) if isinstance(keys, str) else keys:
        value = value[key]
    return form(value) if callable(form) else form.format(value)


def file_text(folder: str, name: str) -> str:
    """A result file's text, without the blank lines around it."""
    return load(folder, name).strip()


def log_match(folder: str, name: str, pattern: str) -> str:
    """The first text of a result file that a regular expression matches: "172 passed, 3 skipped"."""
    return re.search(pattern, load(folder, name)).group(0)


def table(folder: str, name: str = "table.md", index: int = 0) -> str:
    """The `index`-th markdown table of a result file."""
    return tables(load(folder, name))[index]


def column_span(folder: str, header: str, name: str = "table.md", digits: int = 2) -> str:
    """The range of a column of a result file's first table, in percent where its cells are: "1.00-1.03", "57-69%"."""
    cells = [row[header] for row in rows(table(folder, name))]
    percent = "%" if all(cell.endswith("%") for cell in cells) else ""
    return span([float(cell.rstrip("%")) for cell in cells], digits) + percent


def column_met(folder: str, header: str, target: float, at_least: bool = False) -> str:
    """How many cells of a column of a folder's first table are at most (`at_least`: at least) `target` (`met`)."""
    return met(column(table(folder), header), target, at_least)


def ratio(folder: str, name: str, row: int) -> str:
    """One cell of a ratio column of a folder's first table."""
    return f"{column(table(folder), name)[row]:.2f}"


# --------------------------------------------------------------------------------------------- what the docs quote
V2_PLAN_TOTAL = r"at least \d+ runs, [\d.]+ h to go on one process.*h"  # the plan's last line, its totals


def tool_turns_speedup(folder: str, engine: str = "after") -> str:
    """How many times as fast multi-turn sampling ran on `engine` as before (median seconds, before / engine)."""
    return f"{load(folder)['speedup'][engine]:.2f}"


def tool_turns_speedup_range(folder: str, engine: str = "after") -> str:
    """The speed-up of each repetition (before / engine, same repetition), lowest to highest: "1.84-2.37"."""
    seconds = load(folder)["seconds"]
    ratios = sorted(b / e for b, e in zip(seconds["before"], seconds[engine]))
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


def gpu_kit_size(folder: str) -> str:
    """The GPU kit's size, from its build's last line: "50.40 MiB in 7 wheels"."""
    return re.search(r"[\d.]+ MiB in \d+ wheels", load(folder, "build.txt")).group(0)


def gpu_kit_packed(folder: str) -> str:
    """The GPU kit as it travels, from its build's last lines: "30.37 MiB packed, beside a tree of 24.9 MiB"."""
    build = load(folder, "build.txt")
    packed = re.search(r"([\d.]+) MiB packed", build).group(1)
    tree = re.search(r"the tree takes ([\d.]+) of 64", build).group(1)
    return f"{packed} MiB packed, beside a tree of {tree} MiB"


def stress_summary(folder: str) -> str:
    """The stress check's runs: "10 of 10 runs passed, none hung (the longest 1012 s), with 2 cores busy"."""
    results = load(folder)
    totals, burners = results["totals"], {run["burners"] for run in results["runs"]}
    hung = "none hung" if totals["hung_runs"] == 0 else f"{totals['hung_runs']} hung"
    longest = f"the longest {totals['seconds_max']:.0f} s"
    cores = "/".join(map(str, sorted(burners)))
    return f"{totals['passed_runs']} of {totals['runs']} runs passed, {hung} ({longest}), with {cores} cores busy"


def gpu_kit_rehearsal(folder: str) -> str:
    """Each part of the rehearsal and its exit status: "rehearsal 0, rehearsal-tests 0"."""
    parts = re.findall(r"^== ([\w-]+): exit (\d+)", load(folder, "rehearsal.txt"), re.MULTILINE)
    return ", ".join(f"{name} {status}" for name, status in parts)


def iterative_v2_start(folder: str) -> str:
    """The test split's sampled pass@1 at round 0 (the starting model; its samples differ by seed): "0.200-0.201"."""
    starts = [entry["rounds"][0]["test/pass@1"] for entry in ledger(folder).runs.values()]
    return f"{min(starts):.3f}-{max(starts):.3f}"


def learning_table(folder: str) -> str:
    return learning.summarize(load(folder)).split("\n\n")[0]


def dataset(folder: str) -> str:
    rows, positives = load(folder)["dataset"]["rows"], load(folder)["dataset"]["positives"]
    return f"{rows} completions, {positives} of them correct ({positives / rows:.1%})"


def learning_rates() -> str:
    """Greedy pass@1 (mean ± sd over seeds) and invalid rate after the last epoch, per method and learning rate."""
    folders = {"3e-5": "learning-fast-lr3e-5", "1e-4": "learning-fast-lr1e-4", "3e-4": "learning-fast-lr3e-4"}
    results = {rate: load(folder) for rate, folder in folders.items()}
    header = ["method", *[f"lr {rate}: greedy / invalid" for rate in folders]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in [m for m in results["1e-4"]["methods"] if m != "mu"]:
        cells = [method]
        for result in results.values():
            greedy = [run[-1]["pass@1_greedy"] for run in result["methods"][method]]
            invalid = mean(run[-1]["invalid_rate"] for run in result["methods"][method])
            cells.append(f"{mean(greedy):.3f} ± {statistics.stdev(greedy):.3f} / {invalid:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def topr_epoch1_low(folder: str) -> str:
    """TOPR's lowest epoch-1 greedy pass@1 over seeds, and its seed."""
    firsts = [run[0]["pass@1_greedy"] for run in load(folder)["methods"]["topr"]]
    seed = min(range(len(firsts)), key=firsts.__getitem__)
    return f"{firsts[seed]:.3f} on seed {seed}"


def topr_final_vs_mu(folder: str) -> str:
    """TOPR's final greedy pass@1 on each seed next to mu's."""
    finals = " / ".join(f"{run[-1]['pass@1_greedy']:.3f}" for run in load(folder)["methods"]["topr"])
    return f"{finals} against mu's {load(folder)['methods']['mu'][0][-1]['pass@1_greedy']:.3f}"


def ordering(folder: str) -> str:
    """Methods by final greedy pass@1 (mean over seeds), best first."""
    methods = {m: runs for m, runs in load(folder)["methods"].items() if m != "mu"}
    finals = {m: mean(run[-1]["pass@1_greedy"] for run in runs) for m, runs in methods.items()}
    best_first = sorted(finals, key=finals.__getitem__, reverse=True)
    return ", ".join(f"{method} {finals[method]:.3f}" for method in best_first)


def iterative_table(folder: str) -> str:
    """The results' `table.md`, as the benchmark's code of then wrote it (results of earlier protocols included)."""
    return table(folder, "table.md")


def iterative_diagnosis(folder: str, rounds: set[int] | None = None, methods: set[str] | None = None) -> str:
    """`diagnosis.md`'s rows at `rounds`, for `methods` (all by default)."""
    header, rule, *lines = table(folder, "diagnosis.md").splitlines()
    keep = [
        line
        for line in lines
        if (rounds is None or int(line.split("|")[2]) in rounds)
        and (methods is None or line.split("|")[1].strip() in methods)
    ]
    return "\n".join([header, rule, *keep])


def iterative_sweeps(folder: str) -> str:
    """Each method's chosen rate and the validation score of every rate its sweep ran (the mean over the sweep's
    seeds)."""
    results = load(folder)
    seeds = results["settings"].get("sweep_seeds", 1)  # results before sweeps on several seeds: seed 0
    label = "seed 0" if seeds == 1 else f"mean of seeds 0-{seeds - 1}"
    lines = [f"| method | rate | validation sampled pass@1 by rate ({label}) |", "|---|---|---|"]
    for method, entry in results["methods"].items():
        sweep = sorted((float(rate), score) for rate, score in entry["sweep"].items())
        lines.append(
            f"| {method} | {rate_text(entry['lr'])} | "
            + " / ".join(f"{rate_text(rate)}: {score:.3f}" for rate, score in sweep)
            + " |"
        )
    return "\n".join(lines)


def iterative_replay(folder: str) -> str:
    """Each replay arm beside its on-policy counterpart (where the benchmark runs one), at the same sampled
    completions and about the same tokens: test pass@1 after the last round (mean ± sd over seeds, then seed by
    seed) and the difference of the means."""
    methods = load(folder)["methods"]
    lines = [
        "| method | sampled pass@1, on-policy | with replay | difference | seeds (on-policy; replay) "
        "| greedy, on-policy | with replay | tokens sampled (on-policy / replay) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in [m for m in methods if ARMS[m].replay]:
        base = arm.removesuffix("+replay")
        off = [run[-1] for run in methods[arm]["runs"]]
        on = [run[-1] for run in methods[base]["runs"]] if base in methods else []
        cells = [
            [mean_sd([at(r, key) for r in runs]) if runs else "not run" for runs in (on, off)]
            for key in ("pass@1", "pass@1_greedy")
        ]
        difference = f"{mean(at(r, 'pass@1') for r in off) - mean(at(r, 'pass@1') for r in on):+.3f}" if on else "-"
        seeds = "; ".join(" / ".join(f"{at(r, 'pass@1'):.3f}" for r in runs) or "-" for runs in (on, off))
        tokens = " / ".join(str(round(mean(r["sampled_tokens"] for r in runs))) if runs else "-" for runs in (on, off))
        lines.append(
            f"| {base} | {cells[0][0]} | {cells[0][1]} | {difference} | {seeds} | {cells[1][0]} | "
            f"{cells[1][1]} | {tokens} |"
        )
    return "\n".join(lines)


def at(r: dict, key: str) -> float:
    """A round's test metric, in the results of every protocol (see the benchmark's `at`)."""
    return iterative_report.at(r, key)


def mean_sd(values: list[float]) -> str:
    """Mean ± standard deviation, as the benchmarks' tables write them."""
    return iterative_report.mean_std(values)


def iterative_ages(folder: str, rounds: set[int], methods: set[str]) -> str:
    """The replay arms' metrics by sample age (`ages.md`) at `rounds`, for `methods`."""
    header, rule, *lines = table(folder, "ages.md").splitlines()
    keep = [line for line in lines if int(line.split("|")[2]) in rounds and line.split("|")[1].strip() in methods]
    return "\n".join([header, rule, *keep])


def ledger(folder: str):
    """The finished runs of a results folder (`runs/<method>.jsonl`), as the benchmark reads them."""
    READ.add(folder)
    return Ledger(RESULTS / folder)


def iterative_seconds(folder: str) -> list[float]:
    """The seconds each finished run of a results folder's ledger took, of the runs trained by one call (a resumed
    run's seconds are those of the call that finished it)."""
    return [entry["seconds"] for entry in ledger(folder).runs.values() if not entry.get("resumed")]


def resumed_runs(folder: str) -> str:
    """How many of a folder's ledger runs were resumed after a stop: "17"."""
    return str(sum(1 for entry in ledger(folder).runs.values() if entry.get("resumed")))


def iterative_time(folder: str, reduce=sum) -> str:
    """The time a results folder's runs trained (`iterative_seconds`): in all, or a run's mean with `reduce=mean`."""
    return duration(reduce(iterative_seconds(folder)))


def iterative_calls_time(folder: str) -> str:
    """The runs of a folder's ledger and the time of the calls that trained them (the records that list `runs`; a
    call stopped before it finished a run is recorded without a time), as "<runs> runs, by <calls> calls that took
    <hours> h"."""
    calls = [entry for entry in records(folder) if entry.get("runs")]
    runs = sum(len(entry["runs"]) for entry in calls)
    if runs != len(ledger(folder).runs):
        raise ValueError(f"{folder}: its calls list {runs} runs, its ledger holds {len(ledger(folder).runs)}")
    return f"{runs} runs, by {len(calls)} calls that took {sum(entry['seconds'] for entry in calls) / 3600:.1f} h"


def iterative_progress(folder: str) -> str:
    """The runs finished so far in a results folder's ledger, method by method."""
    runs = ledger(folder).runs
    counts = {method: sum(m == method for m, _, _ in runs) for method in ARMS}
    return ", ".join(f"{method} {count}" for method, count in counts.items() if count) or "none"


def iterative_same_rate(folder: str, methods: list[str], lr: float) -> str:
    """Replay arms at one learning rate, round by round (mean over the sweep's seeds, from the ledger): test greedy
    pass@1 and invalid rate, the weight share of the round's own samples (age 0) and the mean log-ratio of the
    oldest samples replayed. Without a taper every age keeps an equal share however far the policy moved."""
    seeds = range(load(folder)["settings"]["sweep_seeds"])
    finished = ledger(folder)
    rows = {
        "greedy pass@1": "pass@1_greedy",
        "invalid rate": "invalid_rate",
        "age-0 weight share": "age_0/weight_share",
    }
    lines = []
    for method in methods:
        runs = [entry["rounds"] for seed in seeds if (entry := finished.get(method, lr, seed)) is not None]
        if len(runs) != len(seeds):
            raise ValueError(f"{folder}: {method} at {lr:g} has {len(runs)} of the sweep's {len(seeds)} seeds")
        rounds = range(1, len(runs[0]))
        if not lines:
            lines = [
                f"| method ({rate_text(lr)}) | per round | " + " | ".join(f"r{r}" for r in rounds) + " |",
                "|---|---|" + "---|" * len(rounds),
            ]
        oldest = [
            max(int(key.split("/")[0].removeprefix("age_")) for key in runs[0][r] if key.startswith("age_"))
            for r in rounds
        ]
        cells = {
            label: [f"{mean(metric(run[r], key) for run in runs):.2f}" for r in rounds] for label, key in rows.items()
        }
        cells["oldest replayed: log-ratio mean"] = [  # none replayed in round 1
            f"{mean(run[r][f'age_{age}/log_ratio_mean'] for run in runs):.2f}" if age else "-"
            for r, age in zip(rounds, oldest)
        ]
        for label, values in cells.items():
            lines.append(f"| {method} | {label} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def metric(r: dict, key: str) -> float:
    """A round's metric: its weights by sample age ("age_0/weight_share") as recorded, its test metrics by `at`."""
    return r[key] if key.startswith("age_") else at(r, key)


def iterative_rates(folder: str, methods: list[str], rounds: list[int]) -> str:
    """The same-rate table: each arm at every rate its sweep ran, from the ledger (mean over the sweep's seeds): the
    validation criterion (sampled pass@1 averaged over rounds 1..R) and the test sampled pass@1 after `rounds`."""
    settings, finished = load(folder)["settings"], ledger(folder)
    seeds = range(settings["sweep_seeds"])
    lines = [
        "| method | rate | validation mean, by seed | " + " | ".join(f"test r{r}" for r in rounds) + " |",
        "|---|---|---|" + "---|" * len(rounds),
    ]
    for method in methods:
        for lr in finished.rates(method):
            entries = [e for seed in seeds if (e := finished.get(method, lr, seed)) is not None]
            if len(entries) != len(seeds):
                continue
            cells = [mean_sd([at(e["rounds"][r], "pass@1") for e in entries]) for r in rounds]
            by_seed = " / ".join(f"{e['validation']['mean']:.3f}" for e in entries)
            lines.append(f"| {method} | {rate_text(lr)} | {by_seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tested(run: list[dict]) -> list[float]:
    """A run's test sampled pass@1 after each round from 1 on that evaluated the test split (every round, or those of
    the scale's `test_rounds`)."""
    return [value for r in run[1:] if (value := at(r, "pass@1")) == value]  # NaN: not tested


def area(run: list[dict]) -> float:
    """A run's test sampled pass@1 averaged over its tested rounds from 1 on: the area under its learning curve
    against completions sampled (every round samples as many)."""
    return mean(tested(run))


def iterative_areas(folder: str, validation: bool = False) -> str:
    """Each arm at its chosen rate, seed by seed: the test sampled pass@1 averaged over the tested rounds from 1 on
    (learning per sampled completion) and after the last round; with `validation`, the validation criterion (the same
    mean over every round, on the validation split) first."""
    results = load(folder)
    rounds = [r["round"] for r in results["methods"][next(iter(results["methods"]))]["runs"][0][1:]]
    some = [r for r in rounds if r in (results["settings"].get("test_rounds") or rounds)]
    label = f"{some[0]}-{some[-1]}" if some == rounds else ", ".join(map(str, some))
    head = ["method", "rate", *(["validation mean, by seed"] if validation else [])]
    head += [f"test mean over rounds {label}, by seed", "after the last round, by seed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, entry in results["methods"].items():
        cells = [[e["mean"] for e in entry["validation"]]] if validation else []
        cells += [[area(run) for run in entry["runs"]], [at(run[-1], "pass@1") for run in entry["runs"]]]
        lines.append(
            f"| {method} | {rate_text(entry['lr'])} | "
            + " | ".join(" / ".join(f"{v:.3f}" for v in values) for values in cells)
            + " |"
        )
    return "\n".join(lines)


def iterative_area(folder: str, method: str) -> str:
    """An arm's test sampled pass@1 averaged over its tested rounds from 1 on, mean ± sd over seeds (learning per
    sampled completion)."""
    return mean_sd([area(run) for run in load(folder)["methods"][method]["runs"]])


def rate_text(rate: float) -> str:
    """1e-05 -> 1e-5, 0.0003 -> 3e-4."""
    return f"{rate:.0e}".replace("e-0", "e-")


def iterative_test(folder: str, method: str, key: str = "pass@1") -> str:
    """Mean ± sd over seeds after the last round, as in the results' table."""
    return mean_sd([at(run[-1], key) for run in load(folder)["methods"][method]["runs"]])


def iterative_seeds(folder: str) -> str:
    """Each method's test pass@1 after the last round, seed by seed: where seeds overlap, methods are not separated."""
    lines = [
        "| method | rate | sampled pass@1, seeds 0 / 1 / 2 | greedy pass@1, seeds 0 / 1 / 2 |",
        "|---|---|---|---|",
    ]
    for method, entry in load(folder)["methods"].items():
        final = [run[-1] for run in entry["runs"]]
        lines.append(
            f"| {method} | {rate_text(entry['lr'])} | "
            + " / ".join(f"{at(r, 'pass@1'):.3f}" for r in final)
            + " | "
            + " / ".join(f"{at(r, 'pass@1_greedy'):.3f}" for r in final)
            + " |"
        )
    return "\n".join(lines)


def iterative_round_span(folder: str, method: str, key: str, rounds: range) -> str:
    """The range over `rounds` of a per-round metric's mean over seeds."""
    runs = load(folder)["methods"][method]["runs"]
    return span([mean(run[r][key] for run in runs) for r in rounds])


def iterative_start(folder: str, key: str, method: str = "topr") -> str:
    """The starting model's test metric (round 0, mean over `method`'s seeds)."""
    return f"{mean(at(run[0], key) for run in load(folder)['methods'][method]['runs']):.3f}"


def arm_runs(folder: str, method: str, lr: float | None = None) -> list[list[dict]]:
    """An arm's runs from the ledger, every seed run there in seed order: at `lr`, or at the arm's chosen rate
    (`results.json`). Not `results.json`'s runs: a call writes them from the ledger as it read it when it started, so
    where two calls of a benchmark ran at once it lacks the runs the other call finished meanwhile."""
    return list(seed_runs(folder, method, lr).values())


def seed_runs(folder: str, method: str, lr: float | None = None) -> dict[int, list[dict]]:
    """`arm_runs` by seed: {seed: rounds} for every seed the ledger holds, in seed order."""
    lr = load(folder)["methods"][method]["lr"] if lr is None else lr
    finished = ledger(folder)
    seeds = range(load(folder)["settings"]["seeds"])
    return {seed: e["rounds"] for seed in seeds if (e := finished.get(method, lr, seed))}


def paired_runs(folder: str, first: str, second: str, lrs: tuple = (None, None)) -> tuple[list, list]:
    """Two arms' runs on the seeds both have run (`seed_runs`), the i-th of each from the same seed: the pairs
    `paired.paired_difference` takes, whichever seeds either arm is missing."""
    a, b = seed_runs(folder, first, lrs[0]), seed_runs(folder, second, lrs[1])
    shared = [seed for seed in a if seed in b]
    return [a[seed] for seed in shared], [b[seed] for seed in shared]


def tested_rounds(folder: str) -> list[int]:
    """The rounds from 1 on at which a scale evaluated its test split (every round, or its `test_rounds`)."""
    settings = load(folder)["settings"]
    return [r for r in range(1, settings["rounds"] + 1) if r in (settings.get("test_rounds") or range(r + 1))]


PAIRED: dict[tuple, paired_stats.Difference] = {}  # the bootstraps computed so far (the docs quote each several times)
PASS_AT: dict[tuple, tuple] = {}  # the same for `pass_at_difference`


def paired(folder: str, first: str, second: str, which: str = "area", lrs: tuple = (None, None)):
    """The paired difference of two arms' test sampled pass@1 (`first` minus `second`, `paired.paired_difference`):
    `which` is "area" (the mean over the tested rounds from 1 on) or "last" (the last round); `lrs` picks rates other
    than the chosen ones (from the ledger)."""
    key = (folder, first, second, which, lrs)
    if key not in PAIRED:
        rounds = tested_rounds(folder) if which == "area" else tested_rounds(folder)[-1:]
        a, b = paired_runs(folder, first, second, lrs)
        PAIRED[key] = paired_stats.paired_difference(a, b, rounds, load(folder)["settings"]["k"])
    return PAIRED[key]


def arm_label(method: str, lr: float | None) -> str:
    return method if lr is None else f"{method} at {rate_text(lr)}"


def iterative_paired(folder: str, pairs: list[tuple]) -> str:
    """Paired differences of arms (first minus second), over the tested rounds from 1 on and after the last round: the
    estimate with its 95% bootstrap interval over seeds and test prompts and its seed-level interval, and the reading
    under both.
    A pair is `(first, second)` at their chosen rates, or `(first, second, lr_first, lr_second)`."""
    lines = [
        "| first | second | mean over the tested rounds | reading | after the last round | reading |",
        "|---|---|---|---|---|---|",
    ]
    for first, second, *lrs in pairs:
        lrs = tuple(lrs) or (None, None)
        cells = []
        for which in ("area", "last"):
            d = paired(folder, first, second, which, lrs)
            cells += [d.text(), d.reading]
        lines.append(f"| {arm_label(first, lrs[0])} | {arm_label(second, lrs[1])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pass_at_difference(folder: str, first: str, second: str, at: int):
    """After the last round, the paired difference of two arms' test pass@`at` (`paired.pass_at`, the unbiased
    estimate from the samples each run's last round drew), over the seeds whose last round of both arms drew at least
    `at` samples a prompt; `None` where fewer than two seeds did. Returns the difference (or `None`) and that count."""
    key = (folder, first, second, at)
    if key not in PASS_AT:
        settings, last = load(folder)["settings"], tested_rounds(folder)[-1]
        runs = [
            (a, b)
            for a, b in zip(*paired_runs(folder, first, second), strict=True)
            if min(run[last].get("test/samples", settings["k"]) for run in (a, b)) >= at
        ]
        d = None
        if len(runs) >= 2:
            d = paired_stats.paired_difference(*map(list, zip(*runs)), [last], settings["k"], at=at)
        PASS_AT[key] = (d, len(runs))
    return PASS_AT[key]


def iterative_pass_at(folder: str, pairs: list[tuple[str, str]], ats: tuple[int, ...] = (1, 4, 16)) -> str:
    """Each pair's `pass_at_difference` for each k of `ats`, with both intervals and the reading under both; "-" where
    fewer than two seeds drew k samples a prompt."""
    lines = ["| first | second | k | seeds | difference after the last round | reading |", "|---|---|---|---|---|---|"]
    for first, second in pairs:
        for at in ats:
            d, seeds = pass_at_difference(folder, first, second, at)
            cells = "- | -" if d is None else f"{d.text()} | {d.reading}"
            lines.append(f"| {first} | {second} | {at} | {seeds} | {cells} |")
    return "\n".join(lines)


def iterative_pass_difference(folder: str, first: str, second: str, at: int) -> str:
    """One `pass_at_difference` with its intervals and its seeds: "+0.020 [+0.010, +0.031] (seeds [...]), 8 seeds"."""
    d, seeds = pass_at_difference(folder, first, second, at)
    if d is None:
        raise ValueError(f"{folder}: fewer than two seeds of {first} and {second} drew {at} test samples a prompt")
    return f"{d.text()}, {seeds} seeds"


def iterative_difference(folder: str, first: str, second: str, which: str = "area", *lrs) -> str:
    """One paired difference, with its interval: "+0.020 [+0.010, +0.031]"."""
    return paired(folder, first, second, which, tuple(lrs) or (None, None)).text()


def iterative_unsolved(folder: str, method: str, lr: float | None = None) -> str:
    """After the last round, seed by seed: the test prompts none of whose k samples was correct, and of those the
    ones whose greedy answer was wrong too: "12 (12 greedy) / 0 (0) / 12 (12) of 128"."""
    runs = arm_runs(folder, method, lr)
    cells = []
    for run in runs:
        last = run[-1]
        never = [i for i, c in enumerate(last["test/correct"]) if c == 0]
        cells.append(f"{len(never)} ({sum(last['test/greedy_correct'][i] == 0 for i in never)})")
    return " / ".join(cells) + f" of {len(runs[0][-1]['test/correct'])}"


def reversal_prompts(folder: str) -> tuple[list[str], list[str]]:
    """The fast scale's training and test prompts, rebuilt from its seed-0 draw (`tasks.reversal_numbers`)."""
    from iterative import SCALES, split_rows, split_sizes
    from tasks import PRETRAIN_ROWS, reversal_numbers, reversal_rows

    if load(folder)["settings"]["prompts"] != SCALES["fast"]["prompts"]:
        raise ValueError(f"{folder} is not the fast scale as it stands in benchmarks/iterative.py")
    sizes = split_sizes(SCALES["fast"])
    train, _, test = split_rows(reversal_rows(reversal_numbers(sum(sizes))[PRETRAIN_ROWS:]), sizes)
    return [row["prompt"] for row in train], [row["prompt"] for row in test]


def in_class(prompt: str) -> bool:
    """The class of reversal prompts whose third digit is 0 ("rev 4 7 0 2 ="), which the fast scale's training prompts
    barely contain."""
    return prompt.split()[3] == "0"


def reversal_class(folder: str) -> str:
    """How many test and training prompts the class holds: "12 of the 128 test prompts, 1 of the 64 training ones"."""
    train, test = reversal_prompts(folder)
    return (
        f"{sum(map(in_class, test))} of the {len(test)} test prompts, {sum(map(in_class, train))} of the "
        f"{len(train)} training ones"
    )


def class_unsolved(folder: str, method: str) -> str:
    """The seeds whose test prompts without a correct sample after the last round are exactly the class: "5 of 8"."""
    test = reversal_prompts(folder)[1]
    members = {i for i, prompt in enumerate(test) if in_class(prompt)}
    runs = arm_runs(folder, method)
    exact = sum({i for i, c in enumerate(run[-1]["test/correct"]) if c == 0} == members for run in runs)
    return f"{exact} of {len(runs)}"


def class_paired(folder: str, first: str, second: str, inside: bool) -> tuple[paired_stats.Difference, int]:
    """The paired difference after the last round on the class's test prompts (`inside`) or on the others, and how
    many prompts it is over."""
    test = reversal_prompts(folder)[1]
    keep = [i for i, prompt in enumerate(test) if in_class(prompt) == inside]

    def subset(runs):
        return [[{"test/correct": [run[-1]["test/correct"][i] for i in keep]}] for run in runs]

    k = load(folder)["settings"]["k"]
    a, b = map(subset, paired_runs(folder, first, second))
    return paired_stats.paired_difference(a, b, [0], k), len(keep)


def class_difference(folder: str, first: str, second: str, inside: bool) -> str:
    """`class_paired` as the docs quote it: "+0.622 [+0.250, +0.875] (seeds [...]) over 12 prompts"."""
    difference, prompts = class_paired(folder, first, second, inside)
    return f"{difference.text()} over {prompts} prompts"


def iterative_curves(folder: str, methods: list[str] | None = None) -> str:
    """Learning curves with intervals: each arm's test sampled pass@1 after every tested round (round 0: the starting
    model), the mean over seeds and test prompts with its 95% bootstrap interval over both."""
    results = load(folder)
    rounds = [0, *tested_rounds(folder)]
    lines = ["| method | rate | " + " | ".join(f"r{r}" for r in rounds) + " |", "|---|---|" + "---|" * len(rounds)]
    for method in methods or results["methods"]:
        runs, k = arm_runs(folder, method), results["settings"]["k"]
        cells = []
        for r in rounds:
            d = paired_stats.arm_interval(runs, [r], k)
            cells.append(f"{d.estimate:.3f} [{d.low:.3f}, {d.high:.3f}]")
        lines.append(f"| {method} | {rate_text(results['methods'][method]['lr'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def complete_arms(folder: str) -> list[str]:
    """The complete arms of a results folder: run on every seed at their chosen rate, which is a swept arm's best rate
    interior to the rates it ran, or a reference's complete arm's rate."""
    results = load(folder)
    methods, seeds = results["methods"], results["settings"]["seeds"]

    def swept(entry: dict) -> bool:
        rates = [float(lr) for lr in entry.get("sweep", {})]
        return "reference" not in entry and len(rates) > 2 and min(rates) < entry["lr"] < max(rates)

    done = {m for m, entry in methods.items() if len(entry["runs"]) == seeds and swept(entry)}
    done |= {
        m
        for m, entry in methods.items()
        if len(entry["runs"]) == seeds
        and entry.get("reference") in done
        and entry["lr"] == methods[entry["reference"]]["lr"]
    }
    return [m for m in methods if m in done]


def iterative_complete_curves(folder: str) -> str:
    """`iterative_curves` of the complete arms (`complete_arms`)."""
    return iterative_curves(folder, complete_arms(folder))


def iterative_complete_pairs(folder: str, pairs: list[tuple[str, str]]) -> str:
    """`iterative_paired` of the pairs whose two arms are complete (`complete_arms`), and the pairs still waiting."""
    done = complete_arms(folder)
    ready = [pair for pair in pairs if set(pair) <= set(done)]
    waiting = "; ".join(f"{first} against {second}" for first, second in pairs if (first, second) not in ready)
    return "\n\n".join(
        ([iterative_paired(folder, ready)] if ready else []) + ([f"Waiting for an arm: {waiting}."] if waiting else [])
    )


def iterative_complete_efficiency(folder: str) -> str:
    """The rows of `efficiency.md` (completions to each threshold, seed by seed) of the complete arms
    (`complete_arms`)."""
    done = complete_arms(folder)
    header, rule, *lines = table(folder, "efficiency.md").splitlines()
    return "\n".join([header, rule, *[line for line in lines if line.split("|")[1].strip() in done]])


def iterative_rate_curves(folder: str, arms: list[tuple[str, float]]) -> str:
    """Learning curves with intervals of arms at given rates (every seed run there, from the ledger): test sampled
    pass@1 after every tested round, and greedy pass@1 after the last, each the mean over seeds and test prompts with
    its 95% bootstrap interval."""
    results = load(folder)
    rounds, k = [0, *tested_rounds(folder)], results["settings"]["k"]
    header = ["method", "rate", "seeds", *[f"r{r}" for r in rounds], "greedy, last round"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, lr in arms:
        runs = arm_runs(folder, method, lr)
        cells = [interval_text(paired_stats.arm_interval(runs, [r], k)) for r in rounds]
        greedy = [[{"test/correct": r[-1]["test/greedy_correct"]}] for r in runs]  # one sample, right or wrong
        cells.append(interval_text(paired_stats.arm_interval(greedy, [0], 1)))
        lines.append(f"| {method} | {rate_text(lr)} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def interval_text(d) -> str:
    """ "0.812 [0.790, 0.833]"."""
    return f"{d.estimate:.3f} [{d.low:.3f}, {d.high:.3f}]"


def importance_rows(method: str, runs: list[list[dict]], rounds: list[int], validation: bool = False) -> list[str]:
    """One arm's rows of an importance table (mean over `runs`): per round, the test sampled pass@1 (and with
    `validation` the validation's, scored every round), the effective sample size and the clamped fraction of the
    round's training steps (`train/...`, each batch's own, averaged), and the effective sample size and clamped
    fraction of its oldest replayed samples at the start of the round (`age_<k>/...`)."""

    def row(label: str, value) -> str:
        return f"| {method} | {label} | " + " | ".join(f"{mean(value(run[r]) for run in runs):.2f}" for r in rounds)

    def oldest(r: dict, key: str) -> float:
        ages = [int(k.split("/")[0].removeprefix("age_")) for k in r if k.startswith("age_") and k.endswith("/rows")]
        return r[f"age_{max(ages)}/{key}"] if ages and max(ages) > 0 else float("nan")

    lines = [row("test sampled pass@1", lambda r: at(r, "pass@1"))]
    if validation:
        lines.append(row("validation sampled pass@1", lambda r: r["validation/pass@1"]))
    lines += [
        row("effective sample size, training", lambda r: r["train/effective_sample_size"]),
        row("clamped fraction, training", lambda r: r["train/clamped_fraction"]),
        row("effective sample size, oldest replayed", lambda r: oldest(r, "effective_sample_size")),
        row("clamped fraction, oldest replayed", lambda r: oldest(r, "clamped_fraction")),
    ]
    return [line.replace("nan", "-") + " |" for line in lines]


def importance_header(label: str, rounds: list[int]) -> list[str]:
    """The header and rule of an importance table: the arm column `label`, then one column per round."""
    return [
        f"| {label} | per round | " + " | ".join(f"r{r}" for r in rounds) + " |",
        "|---|---|" + "---|" * len(rounds),
    ]


def iterative_importance(folder: str, methods: list[str], lr: float, rounds: list[int]) -> str:
    """The importance weights beside the learning curve, at one rate (mean over the sweep's seeds, from the ledger):
    `importance_rows` of each arm."""
    finished, seeds = ledger(folder), range(load(folder)["settings"]["sweep_seeds"])
    lines = importance_header(f"method ({rate_text(lr)})", rounds)
    for method in methods:
        lines += importance_rows(
            method, [e["rounds"] for s in seeds if (e := finished.get(method, lr, s)) is not None], rounds
        )
    return "\n".join(lines)


def iterative_complete_importance(folder: str, methods: list[str], rounds: list[int]) -> str:
    """The importance weights beside the learning curve of those of `methods` that are complete (`complete_arms`),
    each at its chosen rate on every seed, the validation scored every round beside the test: `importance_rows`;
    and the arms still waiting."""
    results, done = load(folder), complete_arms(folder)
    lines = importance_header("method (rate)", rounds)
    for method in [m for m in methods if m in done]:
        label = f"{method} ({rate_text(results['methods'][method]['lr'])})"
        lines += importance_rows(label, arm_runs(folder, method), rounds, validation=True)
    waiting = [m for m in methods if m not in done]
    return "\n".join(lines) + (f"\n\nWaiting for an arm: {', '.join(waiting)}." if waiting else "")


def iterative_seed_differences(folder: str, first: str, second: str) -> str:
    """Two arms' difference seed by seed (first minus second), their test sampled pass@1 averaged over the tested
    rounds from 1 on: for results that kept no per-prompt outcomes, where no interval over the prompts exists."""
    pairs = zip(*paired_runs(folder, first, second), strict=True)
    return " / ".join(f"{area(a) - area(b):+.3f}" for a, b in pairs)


def embedded_rounds(folder: str) -> list[dict]:
    """The recipe's per-round metrics (`metrics.jsonl`), read as the loop reads them."""
    from trl_topr import read_rounds

    READ.add(folder)
    return read_rounds(str(RESULTS / folder))


def embedded_table(folder: str = "embedded") -> str:
    rounds = embedded_rounds(folder)
    before, after = rounds[0], rounds[-1]
    keys = [
        ("pass@1_greedy", "greedy pass@1"),
        ("pass@1", "sampled pass@1"),
        ("maj@4", "maj@4"),
        ("invalid_rate", "invalid rate"),
        ("truncated_rate", "truncated rate"),
    ]
    out = ["| | " + " | ".join(name for _, name in keys) + " |", "|---|" + "---|" * len(keys)]
    for label, metrics in (("before (round 0)", before), (f"after {after['round']} round(s)", after)):
        out.append(f"| {label} | " + " | ".join(f"{metrics[key]:.3f}" for key, _ in keys) + " |")
    return "\n".join(out)


def embedded_metric(key: str, which: int, folder: str = "embedded") -> str:
    return f"{embedded_rounds(folder)[which][key]:.3f}"


def embedded_same_as_fp32(folder: str) -> str:
    """Whether a run of the recipe got the numbers of its float32 run, in words."""
    if embedded_table(folder) == embedded_table("embedded-fp32"):
        return "the same numbers as the float32 run"
    return f"numbers that differ from the float32 run's: see `benchmarks/results/{folder}/`"


def calculator_table(off: str = "embedded-calculator-off", on: str = "embedded-calculator") -> str:
    """The embedded default without and with the calculator tool, before and after its round."""
    rounds = {name: embedded_rounds(folder) for name, folder in (("without", off), ("with", on))}
    keys = [
        ("pass@1_greedy", "greedy pass@1"),
        ("pass@1", "sampled pass@1"),
        ("maj@4", "maj@4"),
        ("invalid_rate", "invalid rate"),
        ("tool_call_rate_greedy", "tool calls per greedy answer"),
        ("tool_call_rate", "tool calls per sample"),
    ]
    columns = [(name, index) for name in rounds for index in (0, -1)]
    headers = [f"{name} the tool, {'before' if i == 0 else 'after 1 round'}" for name, i in columns]
    out = ["| | " + " | ".join(headers) + " |", "|---|" + "---|" * len(columns)]
    for key, label in keys:
        cells = [rounds[name][i].get(key) for name, i in columns]
        out.append(f"| {label} | " + " | ".join("" if v is None else f"{v:.3f}" for v in cells) + " |")
    return "\n".join(out)


# results folder: the kernels it was measured with (the same CPU, held back by environment variables)
PRECISION_RUNS = {
    "precision": "as the CPU allows",
    "precision-avx512": "oneDNN held to AVX512 without BF16",
    "precision-avx2": "torch and oneDNN held to AVX2",
}


def precision_table() -> str:
    """bf16 against float32 matmuls with each kernel set measured, the library's probe beside them, and its choice."""
    lines = [
        "| kernels | fp32 GFLOP/s | bf16 GFLOP/s | bf16/fp32 | the probe's bf16/fp32 | trl-topr picks |",
        "|---|---|---|---|---|---|",
    ]
    for folder, kernels in PRECISION_RUNS.items():
        r = load(folder)
        lines.append(
            f"| {kernels} | {r['fp32_gflops']:.1f} | {r['bf16_gflops']:.1f} | {r['bf16_over_fp32']:.2f} | "
            f"{r['probe_bf16_over_fp32']:.2f} | {r['picks']} |"
        )
    return "\n".join(lines)


def embedded_precision(folder: str = "embedded") -> str:
    """The precision the recipe trained in, as its summary says ("... in bf16 on cpu.")."""
    return re.search(r" in (\w+) on \w+\.\n", load(folder, "log.txt")).group(1)


def embedded_precision_line(folder: str = "embedded") -> str:
    """The line in which the recipe logged its precision and why, as a code block."""
    return "```\n" + log_match(folder, "log.txt", r"Precision: .*") + "\n```"


def logged_precision(folder: str) -> str:
    """The precision a run logged that it computes in ("Precision: bf16 on cpu (...)" -> "bf16")."""
    return re.search(r"Precision: (\w+) on ", load(folder, "log.txt")).group(1)


def embedded_probe(folder: str = "embedded") -> str:
    """The bf16/float32 speedup the precision rule measured in that run, as it logged it."""
    return re.search(r"bf16 matmuls ran ([\d.]+)x float32's", load(folder, "log.txt")).group(1)


STEADY = "second_tokens_per_s"  # vllm_startup.py's second generation: the engine warmed up


def vllm_startup(arm: str, key: str) -> float:
    """A median over the repetitions of one arm of `benchmarks/vllm_startup.py` ("eager" or "compiled")."""
    return statistics.median(run[key] for run in load("vllm-startup")["runs"][arm])


def vllm_startup_median(arm: str, key: str) -> str:
    """`vllm_startup` in whole seconds: "41 s"."""
    return f"{vllm_startup(arm, key):.0f} s"


def vllm_startup_speedup(key: str = STEADY) -> str:
    """The eager arm's median over the compiled arm's (for `STEADY`: how many times faster eager generates)."""
    return f"{vllm_startup('eager', key) / vllm_startup('compiled', key):.2f}"


def vllm_startup_span(arm: str, key: str) -> str:
    """The lowest and highest seconds over an arm's repetitions (a cold compile cache, then a warm one)."""
    values = [run[key] for run in load("vllm-startup")["runs"][arm]]
    return f"{min(values):.0f}-{max(values):.0f} s"


def memory_summary(folder: str = "memory") -> str:
    """Per engine and labelled run of `benchmarks/memory.py` in `folder`: the growth of the resident memory at the
    start of a round, of the peak and of the live memory after round 2 (against round 2), the rounds run, and the most
    trainers of earlier rounds found alive."""
    lines = [
        "| engine | run | rounds | start after round 2 | peak after round 2 | live after round 2 "
        "| earlier trainers alive |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = sorted((load(folder, path.name) for path in (RESULTS / folder).glob("*-*.json")), key=memory_order)
    for run in runs:
        rounds = memory.largest(run)
        trained = [r["round"] for r in rounds if r["round"] > 0]
        growths = " | ".join(memory.growth(rounds, key) for key in ("rss_start", "peak", "rss_live"))
        alive = max(r["earlier_trainers_alive"] for r in rounds[1:])
        lines.append(f"| {run['engine']} | {run['label']} | {len(trained)} | {growths} | {alive} |")
    return "\n".join(lines)


def memory_order(run: dict) -> tuple[int, str]:
    """Runs of `benchmarks/memory.py` by engine, in the benchmark's order, then by start."""
    return memory.ENGINES.index(run["engine"]), run["started"]


def memory_leak(run: str, folder: str = "memory") -> str:
    """How much live memory a run of `benchmarks/memory.py` gained a round, from round 1 to its last (the process
    that gained most): "1.8 GiB"."""
    per_round = []
    for process in load(folder, f"{run}.json")["processes"]:
        live = [r["rss_live"] for r in process["rounds"] if r["round"] >= 1]
        if len(live) < 2:
            raise ValueError(f"{run}: fewer than 2 trained rounds recorded, no growth to measure")
        per_round.append((live[-1] - live[0]) / (len(live) - 1))
    return f"{max(per_round) / 2**30:.1f} GiB"


def trained_at(folder: str) -> str:
    """The commits of the calls that trained a ledger's runs (those of its record not `--report_only`), abbreviated,
    in the order they ran: "d58e6e9" or "d58e6e9, then cd2fb5e"."""
    commits = [entry["commit"][:7] for entry in records(folder) if "--report_only" not in entry["command"]]
    return ", then ".join(dict.fromkeys(commits))


def cell(folder: str, name: str, index: int, where: dict[str, str], header: str) -> str:
    """A cell of the `index`-th table of a folder's markdown file `name`, in the one row whose cells match `where`."""
    table = tables(load(folder, name))[index]
    (row,) = [r for r in rows(table) if all(r[key] == value for key, value in where.items())]
    return row[header]


def staleness_rate_checks(folder: str) -> str:
    """Each swept arm's rates at lag 0 (the mean validation sampled pass@1 over the sweep's seeds and checkpoints, the
    best in bold) and its best with its two neighbours scored again at the largest lag on the same seeds: whether the
    best moves."""
    results = load(folder)
    lag = max(results["settings"]["lags"])
    lines = [f"| arm | at lag 0 | at lag {lag} | best moves |", "|---|---|---|---|"]

    def cells(scores: dict, best: float) -> str:
        ordered = sorted(scores.items(), key=lambda item: float(item[0]))
        return ", ".join(f"**{r} {v:.3f}**" if float(r) == best else f"{r} {v:.3f}" for r, v in ordered)

    for arm, swept in results["rates"].items():
        stale, best = swept.get(f"scores_at_lag_{lag}"), swept.get(f"best_at_lag_{lag}")
        moved = "-" if best is None else ("no" if best == swept["best"] else f"to {best:g}")
        later = "-" if stale is None else cells(stale, best)
        lines.append(f"| {arm} | {cells(swept['scores'], swept['best'])} | {later} | {moved} |")
    return "\n".join(lines)


def gpu_recipe_table() -> str:
    """Before and after the recipe's GPU round, from its log's 'Round N done' lines."""
    found = re.findall(r"Round (\d+) done: (.*)", load("gpu-h100", "recipe.log"))
    metrics = [dict(re.findall(r"([\w@]+) ([\d.]+)", text)) for _, text in found]
    keys = [
        ("pass@1_greedy", "pass@1, greedy"),
        ("pass@1", "pass@1, 8 samples"),
        ("maj@8", "maj@8"),
        ("invalid_rate", "invalid rate (sampled)"),
    ]
    lines = ["| | before | after |", "|---|---|---|"]
    lines += [f"| {name} | {metrics[0][key]} | {metrics[-1][key]} |" for key, name in keys]
    return "\n".join(lines)


def verifier_constant(folder: str = "verifier-embedded") -> str:
    """The accuracy of a verifier that always gives the more frequent verdict: the test solutions' larger share of
    correct or incorrect ones."""
    correct = load(folder, "verifier_results.json")["labels"]["test"]
    return f"{max(correct, 1 - correct):.3f}"


def verifier_tables() -> str:
    results = load("verifier-embedded", "verifier_results.json")
    before, after = results["rounds"][0], results["rounds"][-1]
    lines = [f"| verifier on the test solutions | before | after {after['round']} rounds |", "|---|---|---|"]
    for key, name in [
        ("pass@1_greedy", "accuracy, greedy verdict"),
        ("pass@1", "accuracy, sampled verdicts"),
        ("invalid_rate", "invalid verdicts, sampled"),
        ("invalid_rate_greedy", "invalid verdicts, greedy"),
    ]:
        lines.append(f"| {name} | {before[key]:.3f} | {after[key]:.3f} |")
    votes = results["votes"]
    lines += ["", "| answers to the test questions | verifier before | verifier after |", "|---|---|---|"]
    for key, name in [
        ("pass@1", "generator pass@1"),
        ("majority_vote", "majority vote"),
        ("verifier_vote", "verifier-weighted vote"),
        ("best_of_n", "best-of-n"),
    ]:
        lines.append(f"| {name} | {votes['before'][key]:.3f} | {votes['after'][key]:.3f} |")
    return "\n".join(lines)


# The fast scale's paired comparisons (first, second[, rate of the first, rate of the second]): the questions of
# docs/benchmarks-iterative.md, in its order
FAST_PAIRS = [
    ("topr_peff0.8+replay", "positives_only+replay"),
    ("topr_peff0.8+replay", "positives_only"),
    ("topr_peff0.8", "positives_only"),
    ("topr+replay", "positives_only+replay"),
    ("grpo", "positives_only"),
    ("topr_peff0.8", "topr"),
    ("topr_peff0.8+replay", "topr+replay"),
    ("topr+replay", "topr"),
    ("topr_peff0.5+replay", "topr_peff0.5"),
    ("topr_peff0.8+replay", "topr_peff0.8"),
    ("positives_only+replay", "positives_only"),
    ("reinforce+replay", "reinforce"),
    ("positives_only", "positives_only", 3e-4, 1e-3),
    ("topr_peff0.8+replay", "positives_only", 3e-4, 3e-4),
    ("topr_peff0.8", "topr_peff0.5"),
    ("topr_peff0.8+replay", "topr_peff0.5+replay"),
    ("topr_peff0.8+replay", "topr_peff0.2+replay"),
    ("topr_peff0.8", "grpo"),
]
# the ones the prose quotes, by name
FAST_DIFFERENCES = {
    "q1": (FAST_PAIRS[0], ("area", "last")),
    "q1_on_policy": (FAST_PAIRS[1], ("last",)),
    "peff": (FAST_PAIRS[5], ("area",)),
    "peff_replay": (FAST_PAIRS[6], ("area",)),
    "rate": (FAST_PAIRS[12], ("area", "last")),
    "grpo_rft": (FAST_PAIRS[4], ("area",)),
    "peff_rft": (FAST_PAIRS[2], ("area",)),
    "target": (FAST_PAIRS[14], ("area",)),
    "target_replay": (FAST_PAIRS[15], ("area",)),
    "target_replay_0.2": (FAST_PAIRS[16], ("area",)),
    "replay": (FAST_PAIRS[9], ("area",)),
    "default_grpo": (FAST_PAIRS[17], ("area",)),
}
# real scale v2's questions (first minus second): the loop's default against the paper's setting, the fast scale's
# first question and its on-policy twin, TOPR against positives-only on-policy, replay against on-policy (the
# default of `replay_rounds`) for each, the references, and online GRPO against the loop's default and positives-only
V2_PAIRS = [
    ("topr_peff0.8+replay", "topr+replay"),
    ("topr_peff0.8+replay", "positives_only+replay"),
    ("topr_peff0.8+replay", "positives_only"),
    ("topr_peff0.8", "positives_only"),
    ("topr_peff0.8+replay", "topr_peff0.8"),
    ("positives_only+replay", "positives_only"),
    ("topr_peff0.8+replay", "reinforce+replay"),
    ("topr_peff0.8+replay", "grpo"),
    ("grpo", "positives_only"),
]
# what TOPR's negatives may add beyond pass@1: pass@k of the arms whose seeds 3-7 run with 16 test samples a prompt
V2_PASS_PAIRS = [
    ("topr_peff0.8+replay", "positives_only+replay"),
    ("topr_peff0.8+replay", "positives_only"),
    ("positives_only+replay", "positives_only"),
]
# the pairs whose pass@k the prose quotes, by name (each pair once both arms hold every seed)
V2_PASS_QUOTED = {
    "peff_replay_rft_replay": V2_PASS_PAIRS[0],
    "peff_replay_rft": V2_PASS_PAIRS[1],
    "rft_replay": V2_PASS_PAIRS[2],
}
# the ones the prose quotes, by name
V2_DIFFERENCES = {
    "peff_replay": (V2_PAIRS[0], ("area", "last")),
    "replay": (V2_PAIRS[4], ("area",)),
    "q1_on_policy": (V2_PAIRS[2], ("last",)),
    "peff": (V2_PAIRS[3], ("area",)),
    "grpo": (V2_PAIRS[7], ("area", "last")),
    "grpo_rft": (V2_PAIRS[8], ("area", "last")),
    "peff_replay_rft_replay": (V2_PAIRS[1], ("area", "last")),
    "rft_replay": (V2_PAIRS[5], ("area", "last")),
    "reinforce_replay": (V2_PAIRS[6], ("area", "last")),
}
FAST = "iterative-fast-8"  # the fast scale read on 8 seeds (its first 3 are iterative-fast's runs)
BEFORE = "iterative-easy-before-replay"  # the real scale as first run: on-policy rounds, the earlier protocol
ON_POLICY_ARMS = [m for m in ARMS if not ARMS[m].replay]  # the iterative benchmark's arms
REPLAY_ARMS = [m for m in ARMS if ARMS[m].replay]


def staleness_tables(folder: str) -> tuple[tuple, tuple]:
    """Where a staleness result's readings.md holds its table of TOPR against each arm and that of each arm's
    learning, as `cell`'s first arguments."""
    return (folder, "readings.md", 0), (folder, "readings.md", 1)


def staleness_differences(name: str, against: tuple, picks: list[tuple[str, str, str]]) -> dict[str, tuple]:
    """Quotes of single cells of a staleness result's table of TOPR against each arm: for each `(other, lag, which)`
    ("area" or "last"), `<name>.vs_<other>_<lag>` (with `_last` for the last checkpoint)."""
    return {
        f"{name}.vs_{other}_{lag}{'_last' if which == 'last' else ''}": (
            cell,
            *against,
            {"lag": lag, "TOPR minus": other},
            which,
        )
        for other, lag, which in picks
    }


AGAINST, LEARNED = staleness_tables("staleness-v2")
SCARCE_AGAINST, SCARCE_LEARNED = staleness_tables("staleness-scarce")
# name in the docs -> (function, *arguments): the docs quote function(*arguments), mostly (helper, folder, ...)
QUOTES: dict[str, tuple] = {
    # the embedded default (README's first command)
    "embedded.table": (embedded_table,),
    "embedded.time": (run_time, "embedded"),
    "embedded.machine": (machine, "embedded"),
    "embedded.precision": (embedded_precision,),
    "embedded.precision_line": (embedded_precision_line,),
    "embedded.greedy.before": (embedded_metric, "pass@1_greedy", 0),
    "embedded.greedy.after": (embedded_metric, "pass@1_greedy", -1),
    "embedded.commit": (commit, "embedded"),
    # the embedded default with a calculator tool
    "calculator.table": (calculator_table,),
    "calculator.time": (run_time, "embedded-calculator"),
    "calculator.machine": (machine, "embedded-calculator"),
    "calculator.precision": (embedded_precision, "embedded-calculator"),
    "calculator.commit": (commit, "embedded-calculator"),
    "calculator.greedy.off": (embedded_metric, "pass@1_greedy", 0, "embedded-calculator-off"),
    "calculator.greedy.on": (embedded_metric, "pass@1_greedy", 0, "embedded-calculator"),
    "calculator.greedy.on.after": (embedded_metric, "pass@1_greedy", -1, "embedded-calculator"),
    "calculator.sampled.off": (embedded_metric, "pass@1", 0, "embedded-calculator-off"),
    "calculator.sampled.on": (embedded_metric, "pass@1", 0, "embedded-calculator"),
    "calculator.sampled.on.after": (embedded_metric, "pass@1", -1, "embedded-calculator"),
    "calculator.calls.greedy": (embedded_metric, "tool_call_rate_greedy", 0, "embedded-calculator"),
    "calculator.calls": (embedded_metric, "tool_call_rate", 0, "embedded-calculator"),
    "calculator.calls.after": (embedded_metric, "tool_call_rate", -1, "embedded-calculator"),
    "calculator.invalid.on": (embedded_metric, "invalid_rate", 0, "embedded-calculator"),
    "calculator.invalid.off": (embedded_metric, "invalid_rate", 0, "embedded-calculator-off"),
    "calculator.off.time": (run_time, "embedded-calculator-off"),
    "calculator.greedy.off.after": (embedded_metric, "pass@1_greedy", -1, "embedded-calculator-off"),
    "calculator.sampled.off.after": (embedded_metric, "pass@1", -1, "embedded-calculator-off"),
    "calculator.positives": (embedded_metric, "positive_fraction", -1, "embedded-calculator"),
    # the same configuration at an earlier commit, on a CPU with AVX512-BF16, when the loop trained with baseline 0
    "calculator-baseline0.machine": (machine, "embedded-calculator-baseline0"),
    "calculator-baseline0.precision": (embedded_precision, "embedded-calculator-baseline0"),
    "calculator-baseline0.commit": (commit, "embedded-calculator-baseline0"),
    "calculator-baseline0.positives": (embedded_metric, "positive_fraction", -1, "embedded-calculator-baseline0"),
    "calculator-baseline0.greedy.after": (embedded_metric, "pass@1_greedy", -1, "embedded-calculator-baseline0"),
    "calculator-baseline0.sampled.after": (embedded_metric, "pass@1", -1, "embedded-calculator-baseline0"),
    "calculator-baseline0.calls.after": (embedded_metric, "tool_call_rate", -1, "embedded-calculator-baseline0"),
    # the embedded default's precisions at an earlier commit on a CPU with AVX512-BF16: bf16 (the probe's choice),
    # float32, and with the kernels held to AVX2
    "embedded-bf16.time": (run_time, "embedded-bf16"),
    "embedded-bf16.machine": (machine, "embedded-bf16"),
    "embedded-bf16.precision": (embedded_precision, "embedded-bf16"),
    "embedded-bf16.commit": (commit, "embedded-bf16"),
    "embedded-fp32.commit": (commit, "embedded-fp32"),
    "embedded-fp32.time": (run_time, "embedded-fp32"),
    "embedded-avx2.time": (run_time, "embedded-avx2"),
    "embedded-avx2.precision": (embedded_precision, "embedded-avx2"),
    "embedded-avx2.same": (embedded_same_as_fp32, "embedded-avx2"),
    # learning, real scale
    "learning-real.table": (learning_table, "learning-real"),
    "learning-real.machine": (machine, "learning-real"),
    "learning-real.commit": (commit, "learning-real"),
    "learning-real.time": (result_value, "learning-real", "seconds", duration),
    "learning-real.ordering": (ordering, "learning-real"),
    "learning-real.dataset": (dataset, "learning-real"),
    # learning, fast scale: the learning rate 1e-4, and the 3e-5 and 3e-4 beside it
    "learning-fast.table": (learning_table, "learning-fast-lr1e-4"),
    "learning-fast.rates": (learning_rates,),
    "learning-fast.ordering": (ordering, "learning-fast-lr1e-4"),
    "learning-fast.topr_epoch1_3e-4": (topr_epoch1_low, "learning-fast-lr3e-4"),
    "learning-fast.topr_final_3e-5": (topr_final_vs_mu, "learning-fast-lr3e-5"),
    "learning-fast.time": (run_time, "learning-fast-lr1e-4"),
    "learning-fast.machine": (machine, "learning-fast-lr1e-4"),
    "learning-fast.dataset": (dataset, "learning-fast-lr1e-4"),
    # iterative, fast scale
    "iterative-fast.table": (iterative_table, FAST),
    "iterative-fast.curves": (iterative_curves, FAST),
    "iterative-fast.sweeps": (iterative_sweeps, FAST),
    "iterative-fast.diagnosis": (iterative_diagnosis, FAST, {1, 4, 8}, {*ON_POLICY_ARMS, "topr+replay"}),
    "iterative-fast.replay": (iterative_replay, FAST),
    "iterative-fast.same_rate": (
        iterative_same_rate,
        FAST,
        ["reinforce+replay", "tis+replay", "topr+replay"],
        1e-5,
    ),
    "iterative-fast.ages": (iterative_ages, FAST, {2, 4, 8}, {"topr+replay", "topr_peff0.2+replay"}),
    "iterative-fast.time": (iterative_time, "iterative-fast"),
    "iterative-fast.efficiency": (table, FAST, "efficiency.md"),
    "iterative-fast.areas": (iterative_areas, FAST),
    "iterative-fast.rates": (iterative_rates, FAST, REPLAY_ARMS, [2, 4, 8]),
    "iterative-fast.paired": (iterative_paired, FAST, FAST_PAIRS),
    **{
        f"iterative-fast.difference.{name}.{which}": (
            iterative_difference,
            FAST,
            *pair[:2],
            which,
            *pair[2:],
        )
        for name, (pair, whiches) in FAST_DIFFERENCES.items()
        for which in whiches
    },
    **{
        f"iterative-fast.plateau.{method}{'_' + rate_text(lr) if lr else ''}": (
            iterative_unsolved,
            FAST,
            method,
            lr,
        )
        for method, lr in (
            ("positives_only", None),
            ("positives_only+replay", None),
            ("topr_peff0.8+replay", None),
            ("positives_only", 3e-4),
        )
    },
    "iterative-fast.rate_curves": (
        iterative_rate_curves,
        FAST,
        [
            ("positives_only", 3e-4),
            ("positives_only", 1e-3),
            ("positives_only+replay", 3e-4),
            ("topr_peff0.8+replay", 3e-4),
        ],
    ),
    "iterative-fast.importance": (
        iterative_importance,
        FAST,
        ["reinforce+replay", "tis+replay", "topr+replay"],
        1e-5,
        list(range(1, 9)),
    ),
    "iterative-fast.importance_1e-4": (
        iterative_importance,
        FAST,
        ["reinforce+replay", "tis+replay", "topr+replay"],
        1e-4,
        list(range(1, 9)),
    ),
    "iterative-fast.class": (reversal_class, FAST),
    "iterative-fast.class_unsolved.positives_only": (class_unsolved, FAST, "positives_only"),
    "iterative-fast.class_unsolved.positives_only+replay": (class_unsolved, FAST, "positives_only+replay"),
    **{
        f"iterative-fast.class_difference.{where}": (class_difference, FAST, *FAST_PAIRS[1], where == "inside")
        for where in ("inside", "outside")
    },
    "iterative-fast.commit": (commit, "iterative-fast"),
    "iterative-fast.machine": (machine, "iterative-fast"),
    "iterative-fast.start": (iterative_start, FAST, "pass@1"),
    # iterative, the real scale (finished) and the easy task (stopped)
    "iterative-easy.progress": (iterative_progress, "iterative-easy"),
    "iterative-easy.run_time": (iterative_time, "iterative-easy", mean),
    "iterative-real.progress": (iterative_progress, "iterative-real"),
    "iterative-real.machine": (machine, "iterative-real"),
    "iterative-real.sweep": (table, "iterative-real", "sweep.md"),
    # real scale v2, running: its plan and the runs finished so far
    "iterative-real-v2.commit": (training_commit, "iterative-real-v2"),
    "iterative-real-v2.tables_commit": (tables_commit, "iterative-real-v2"),
    "iterative-real-v2.calls": (iterative_calls_time, "iterative-real-v2"),
    "iterative-real-v2.sweep": (table, "iterative-real-v2", "sweep.md"),
    "iterative-real-v2.efficiency": (iterative_complete_efficiency, "iterative-real-v2"),
    "iterative-real-v2.start": (iterative_v2_start, "iterative-real-v2"),
    # v2's questions, each read once both its arms are complete (an arm's rate interior to its sweep, or a reference
    # at its arm's rate, on every seed)
    "iterative-real-v2.curves": (iterative_complete_curves, "iterative-real-v2"),
    "iterative-real-v2.paired": (iterative_complete_pairs, "iterative-real-v2", V2_PAIRS),
    "iterative-real-v2.pass_at": (iterative_pass_at, "iterative-real-v2", V2_PASS_PAIRS),
    "iterative-real-v2.importance": (
        iterative_complete_importance,
        "iterative-real-v2",
        ["reinforce+replay", "topr+replay", "topr_peff0.8+replay"],
        list(range(1, 7)),
    ),
    **{
        f"iterative-real-v2.difference.{name}.{which}": (iterative_difference, "iterative-real-v2", *pair, which)
        for name, (pair, whiches) in V2_DIFFERENCES.items()
        for which in whiches
    },
    "iterative-real-v2-plan.machine": (machine, "iterative-real-v2-plan"),
    "iterative-real-v2-plan.total": (log_match, "iterative-real-v2-plan", "log.txt", V2_PLAN_TOTAL),
    "iterative-real.table": (iterative_table, "iterative-real"),
    "iterative-real.diagnosis": (iterative_diagnosis, "iterative-real", {1, 4}),
    **{
        f"iterative-real.train_positive_r{r}": (
            iterative_round_span,
            "iterative-real",
            "positives_only",
            "positive_fraction",
            range(r, r + 1),
        )
        for r in (1, 4)
    },
    "iterative-real.last.positives_only": (iterative_test, "iterative-real", "positives_only"),
    "iterative-real.last.topr+replay": (iterative_test, "iterative-real", "topr+replay"),
    "iterative-real.last.reinforce+replay": (iterative_test, "iterative-real", "reinforce+replay"),
    "iterative-real.invalid.reinforce+replay": (iterative_test, "iterative-real", "reinforce+replay", "invalid_rate"),
    "iterative-real.areas": (iterative_areas, "iterative-real", True),
    "iterative-real.commit": (commit, "iterative-real"),
    "iterative-real.time": (iterative_time, "iterative-real"),
    "iterative-real.start": (iterative_start, "iterative-real", "pass@1", "positives_only"),
    "iterative-real.start_greedy": (iterative_start, "iterative-real", "pass@1_greedy", "positives_only"),
    "iterative-real.seed_differences": (
        iterative_seed_differences,
        "iterative-real",
        "positives_only+replay",
        "topr_peff0.8+replay",
    ),
    # the real scale's on-policy rows, recorded before the replay arms and the protocol's fixes
    f"{BEFORE}.start": (iterative_start, BEFORE, "pass@1"),
    f"{BEFORE}.start_invalid": (iterative_start, BEFORE, "invalid_rate"),
    f"{BEFORE}.table": (iterative_table, BEFORE),
    f"{BEFORE}.seeds": (iterative_seeds, BEFORE),
    f"{BEFORE}.topr_positive_fraction": (iterative_round_span, BEFORE, "topr", "positive_fraction", range(2, 5)),
    f"{BEFORE}.sweep": (table, BEFORE, "sweep.md"),
    f"{BEFORE}.machine": (machine, BEFORE),
    f"{BEFORE}.diagnosis": (iterative_diagnosis, BEFORE),
    f"{BEFORE}.commit": (commit, BEFORE),
    f"{BEFORE}.positives_only": (iterative_test, BEFORE, "positives_only"),
    f"{BEFORE}.topr": (iterative_test, BEFORE, "topr"),
    f"{BEFORE}.reinforce": (iterative_test, BEFORE, "reinforce"),
    # cost on this machine: a step of TOPR against SFT's and KTO's
    "cost.table": (table, "cost"),
    "cost.command": (command, "cost"),
    "cost.time": (run_time, "cost"),
    "cost.machine": (machine, "cost"),
    "cost.commit": (commit, "cost"),
    "cost.precision": (result_value, "cost", ("settings", "precision")),
    "cost.step": (column_span, "cost", "TOPR/SFT"),
    "cost.memory": (column_span, "cost", "mem TOPR/SFT"),
    "cost.total": (column_span, "cost", "TOPR+pre total/SFT total"),
    "cost.step.met": (column_met, "cost", "TOPR/SFT", 1.03),
    "cost.memory.met": (column_met, "cost", "mem TOPR/SFT", 1.02),
    "cost.total.met": (column_met, "cost", "TOPR+pre total/SFT total", 1.4),
    "cost.pre_memory": (column_span, "cost", "mem TOPR+pre/SFT"),
    "cost.kto": (column_span, "cost", "TOPR/KTO"),
    "cost.kto_memory": (column_span, "cost", "mem TOPR/KTO"),
    # cost of completions of mixed lengths: padding-free and grouped batches
    "cost-mix.table": (table, "cost-mix"),
    "cost-mix.command": (command, "cost-mix"),
    "cost-mix.time": (run_time, "cost-mix"),
    "cost-mix.machine": (machine, "cost-mix"),
    "cost-mix.precision": (result_value, "cost-mix", ("settings", "precision")),
    "cost-mix.vs_sft": (column_span, "cost-mix", "TOPR-pf/SFT-pf"),
    "cost-mix.vs_sft.met": (column_met, "cost-mix", "TOPR-pf/SFT-pf", 0.97, True),
    "cost-mix.vs_padded": (column_span, "cost-mix", "TOPR-pf/TOPR"),
    "cost-mix.vs_padded.met": (column_met, "cost-mix", "TOPR-pf/TOPR", 1.0, True),
    "cost-mix.grouped": (column_span, "cost-mix", "TOPR-grouped/TOPR"),
    "cost-mix.memory": (column_span, "cost-mix", "mem TOPR-pf/TOPR"),
    "cost-mix.padded_share": (column_span, "cost-mix", "padded share TOPR", "table.md", 0),
    "cost-mix.grouped_share": (column_span, "cost-mix", "padded share TOPR-grouped", "table.md", 0),
    # sampling, with transformers and with vLLM
    "sampling.table": (table, "sampling"),
    "sampling.machine": (machine, "sampling"),
    "sampling.commit": (commit, "sampling"),
    "sampling.sampler": (ratio, "sampling", "ratio (target >= 0.9)", 0),
    "sampling.precompute": (ratio, "sampling", "ratio (target >= 0.9)", 1),
    "sampling.fused": (ratio, "sampling", "ratio (target >= 0.9)", 2),
    # multi-turn sampling with the calculator: as before, key/values kept between turns, every key/value once
    "tool-turns.table": (table, "tool-turns"),
    "tool-turns.machine": (machine, "tool-turns"),
    "tool-turns.commit": (commit, "tool-turns"),
    "tool-turns.speedup": (tool_turns_speedup, "tool-turns"),
    "tool-turns.speedup.turns": (tool_turns_speedup, "tool-turns", "turns"),
    "tool-turns.speedup.range": (tool_turns_speedup_range, "tool-turns"),
    # training with glibc's default allocator against a fixed 1 MiB mmap threshold (the memory docs' advice)
    "allocator.table": (table, "allocator"),
    "allocator.machine": (machine, "allocator"),
    "allocator.commit": (commit, "allocator"),
    "allocator.seconds_ratio": (result_value, "allocator", "seconds_ratio", "{:.2f}"),
    "allocator.peak_ratio": (result_value, "allocator", "peak_ratio", "{:.2f}"),
    # training with denormal floats flushed (as shipped) against kept, on negatives a vLLM engine sampled
    "denormals.table": (table, "denormals"),
    "denormals.machine": (machine, "denormals"),
    "denormals.commit": (commit, "denormals"),
    "denormals.ratio": (result_value, "denormals", "seconds_ratio", "{:.2f}"),
    "denormals.same_losses": (result_value, "denormals", "same_losses", {True: "the same", False: "different"}.get),
    "gpu-kit.size": (gpu_kit_size, "gpu-kit"),
    "gpu-kit.packed": (gpu_kit_packed, "gpu-kit"),
    # the multi-process tests again and again with every core busy
    "stress.summary": (stress_summary, "stress"),
    "stress.machine": (machine, "stress"),
    "stress.commit": (commit, "stress"),
    "gpu-kit.rehearsal": (gpu_kit_rehearsal, "gpu-kit"),
    "gpu-kit.machine": (machine, "gpu-kit"),
    "gpu-kit.commit": (commit, "gpu-kit"),
    "sampling-vllm.table": (table, "sampling-vllm"),
    "sampling-vllm.machine": (machine, "sampling-vllm"),
    "sampling-vllm.commit": (commit, "sampling-vllm"),
    "sampling-vllm.versions": (package_versions, "sampling-vllm", {"vllm": "vLLM", "transformers": "transformers"}),
    "sampling-vllm.ratio": (ratio, "sampling-vllm", "ratio to transformers (target >= 2)", 1),
    "sampling-vllm.start": (result_value, "sampling-vllm", ("vllm", "start_seconds"), "{:.0f} s"),
    "sampling-vllm.reload": (result_value, "sampling-vllm", ("vllm", "reload_seconds"), median_seconds),
    # precision: bf16 against float32 matmuls, with each kernel set
    "precision.table": (precision_table,),
    "precision.machine": (machine, "precision"),
    "precision.ratio": (result_value, "precision", "bf16_over_fp32", "{:.2f}"),
    "precision.picks": (result_value, "precision", "picks"),
    "precision-avx2.ratio": (result_value, "precision-avx2", "bf16_over_fp32", "{:.2f}"),
    "precision-avx512.ratio": (result_value, "precision-avx512", "bf16_over_fp32", "{:.2f}"),
    # vLLM's start-up, eager and compiled
    "vllm-startup.table": (table, "vllm-startup"),
    "vllm-startup.eager": (vllm_startup_median, "eager", "start_up_s"),
    "vllm-startup.compiled": (vllm_startup_span, "compiled", "start_up_s"),
    "vllm-startup.first_samples": (vllm_startup_median, "eager", "to_first_samples_s"),
    "vllm-startup.compiled_first_samples": (vllm_startup_span, "compiled", "to_first_samples_s"),
    "vllm-startup.steady": (vllm_startup_speedup, STEADY),
    # memory round after round
    "memory.table": (file_text, "memory", "table.md"),
    "memory.summary": (memory_summary, "memory"),
    "memory-before-give-back.summary": (memory_summary, "memory-before-give-back"),
    "memory-trimmed.summary": (memory_summary, "memory-trimmed"),
    "memory-trimmed.zero3_leak": (memory_leak, "zero3-before", "memory-trimmed"),
    # one NVIDIA H100 (logs of benchmarks/gpu.sh)
    "gpu-h200.machine": (machine, "gpu-h200"),
    "gpu-h200.versions": (package_versions, "gpu-h200"),
    "gpu-h200.commit": (commit, "gpu-h200", 0),
    "gpu-h200.tests": (log_match, "gpu-h200", "tests.log", r"\d+ passed(, \d+ skipped)?"),
    "gpu-h200.limits": (time_limits, "gpu-h200", (1,)),
    "gpu-h200.mfu": (table, "gpu-h200/mfu"),
    "gpu-h200.mfu_topr": (column_span, "gpu-h200/mfu", "TOPR MFU", "table.md", 1),
    "gpu-h200.step": (table, "gpu-h200/step"),
    "gpu-h200.qlora_loop": (log_match, "gpu-h200", "qlora-loop.log", r"Done in [^.]*"),
    "iterative-fast.difference.paper_grpo.area": (iterative_difference, FAST, "topr", "grpo"),
    "iterative-real-v2.difference.paper_replay_grpo.area": (
        iterative_difference,
        "iterative-real-v2",
        "topr+replay",
        "grpo",
    ),
    "iterative-real-v2.difference.rft_replay_grpo.area": (
        iterative_difference,
        "iterative-real-v2",
        "positives_only+replay",
        "grpo",
    ),
    "iterative-real-v2-8.commit": (trained_at, "iterative-real-v2-8"),
    "iterative-real-v2-8.progress": (iterative_progress, "iterative-real-v2-8"),
    "iterative-real-v2-8.pass_at": (iterative_pass_at, "iterative-real-v2-8", V2_PASS_PAIRS),
    **{
        f"iterative-real-v2-8.pass_at.{name}.{at}": (iterative_pass_difference, "iterative-real-v2-8", *pair, at)
        for name, pair in V2_PASS_QUOTED.items()
        for at in (1, 4, 16)
    },
    "iterative-fast-8.commit": (trained_at, "iterative-fast-8"),
    "iterative-fast-8.machine": (machine, "iterative-fast-8"),
    "iterative-fast-8.progress": (iterative_progress, "iterative-fast-8"),
    "iterative-real-v2.resumed": (resumed_runs, "iterative-real-v2"),
    "staleness-v2.machine": (machine, "staleness-v2"),
    "staleness-v2.commit": (trained_at, "staleness-v2"),
    "staleness-v2.rates": (staleness_rate_checks, "staleness-v2"),
    "staleness-v2.table": (table, "staleness-v2"),
    "staleness-v2.learning": (table, *LEARNED),
    "staleness-v2.readings": (table, *AGAINST),
    "staleness-v2.topr_cost_32": (cell, *LEARNED, {"arm": "topr", "lag": "32"}, "area minus lag 0's"),
    "staleness-v2.trl_cost_2": (cell, *LEARNED, {"arm": "trl", "lag": "2"}, "area minus lag 0's"),
    "staleness-v2.keep_cost_32": (cell, *LEARNED, {"arm": "trl+keep", "lag": "32"}, "area minus lag 0's"),
    **staleness_differences(
        "staleness-v2",
        AGAINST,
        [
            ("reinforce", "2", "area"),
            ("reinforce", "8", "area"),
            ("reinforce", "32", "area"),
            ("reinforce", "32", "last"),
            ("tis", "8", "area"),
            ("tis", "32", "area"),
            ("positives_only", "2", "area"),
            ("positives_only", "8", "area"),
            ("positives_only", "32", "last"),
            ("trl", "0", "area"),
            ("trl", "2", "area"),
            ("trl", "32", "area"),
        ],
    ),
    "staleness-scarce.machine": (machine, "staleness-scarce"),
    "staleness-scarce.commit": (trained_at, "staleness-scarce"),
    "staleness-scarce.rates": (staleness_rate_checks, "staleness-scarce"),
    "staleness-scarce.table": (table, "staleness-scarce"),
    "staleness-scarce.learning": (table, *SCARCE_LEARNED),
    "staleness-scarce.readings": (table, *SCARCE_AGAINST),
    "staleness-scarce.start": (cell, "staleness-scarce", "table.md", 0, {"arm": "topr", "lag": "0"}, "0"),
    **staleness_differences(
        "staleness-scarce",
        SCARCE_AGAINST,
        [
            ("reinforce", "0", "area"),
            ("reinforce", "0", "last"),
            ("reinforce", "8", "area"),
            ("positives_only", "0", "area"),
            ("positives_only", "8", "area"),
        ],
    ),
    "gpu-h200-tests.commit": (commit, "gpu-h200-tests", 0),
    "gpu-h200-tests.tests": (log_match, "gpu-h200-tests", "tests.log", r"\d+ passed(, \d+ skipped)?"),
    "gpu-h200-padding-free.commit": (commit, "gpu-h200-padding-free", 0),
    "gpu-h200-padding-free.table": (table, "gpu-h200-padding-free/r"),
    "gpu-h200-padding-free.ratio": (column_span, "gpu-h200-padding-free/r", "TOPR-pf/TOPR"),
    "gpu-h200-padding-free.memory": (column_span, "gpu-h200-padding-free/r", "mem TOPR-pf/TOPR"),
    "gpu-h200-padding-free.time": (run_time, "gpu-h200-padding-free", 0),
    # the default parts run again on the same kind of machine, at a later commit, and padding-free once more
    "gpu-h200-rerun.commit": (commit, "gpu-h200-rerun", 0),
    "gpu-h200-rerun.tests": (log_match, "gpu-h200-rerun", "tests.log", r"\d+ passed(, \d+ skipped)?"),
    "gpu-h200-rerun.limits": (time_limits, "gpu-h200-rerun", (1,)),
    "gpu-h200-rerun.mfu": (table, "gpu-h200-rerun/mfu"),
    "gpu-h200-rerun.step": (table, "gpu-h200-rerun/step"),
    "gpu-h200-rerun.padding_free": (table, "gpu-h200-rerun/padding-free-again/r"),
    "gpu-h200-rerun.padding_free_time": (run_time, "gpu-h200-rerun/padding-free-again", 0),
    "gpu-h100.cost": (table, "gpu-h100", "cost-reps2.log"),
    "gpu-h100.qlora": (table, "gpu-h100", "qlora.log"),
    "gpu-h100.sampling": (table, "gpu-h100", "sampling.log"),
    "gpu-h100.profile": (table, "gpu-h100", "profile.log"),
    "gpu-h100.machine": (machine, "gpu-h100"),
    "gpu-h100.versions": (package_versions, "gpu-h100"),
    "gpu-h100.commit": (commit, "gpu-h100", 0),
    "gpu-h100.tests": (log_match, "gpu-h100", "tests.log", r"\d+ passed(, \d+ skipped)?"),
    "gpu-h100.qlora_step": (column_span, "gpu-h100", "TOPR/SFT", "qlora.log"),
    "gpu-h100.recipe": (gpu_recipe_table,),
    "gpu-h100-padding-free.commit": (commit, "gpu-h100-padding-free", 0),
    "gpu-h100-padding-free.tests": (log_match, "gpu-h100-padding-free", "padding-free-test.log", r"\d+ passed"),
    "gpu-h100-padding-free.limits": (time_limits, "gpu-h100-padding-free", (1, 2)),
    # the verifier recipe's embedded configuration
    "verifier.tables": (verifier_tables,),
    "verifier.time": (run_time, "verifier-embedded"),
    "verifier.machine": (machine, "verifier-embedded"),
    "verifier.precision": (logged_precision, "verifier-embedded"),
    "verifier.correct": (result_value, "verifier-embedded", ("labels", "test"), "{:.3f}", "verifier_results.json"),
    "verifier.constant": (verifier_constant,),
    "verifier-embedded.commit": (commit, "verifier-embedded"),
}


# ------------------------------------------------------------------------------------------------------ rewriting
# (results folder, name) -> a quote and the folders it read: computed once per process (the results do not change
# while it renders, and the docs quote some results several times)
QUOTED: dict[tuple[str, str], tuple[str, frozenset[str]]] = {}


def render(text: str) -> str:
    """`text` with every marked quote rewritten from the results. Raises `KeyError` for a name not in `QUOTES`."""

    def quote(name: str) -> str:
        if name not in QUOTES:
            raise KeyError(f"No result is quoted as {name!r}: the names are those of QUOTES in benchmarks/report.py.")
        key = (str(RESULTS), name)
        if key not in QUOTED:
            before = set(READ)
            READ.clear()
            try:
                function, *arguments = QUOTES[name]
                QUOTED[key] = function(*arguments), frozenset(READ)
            finally:
                READ.update(before)
        quoted, read = QUOTED[key]
        READ.update(read)
        return quoted

    def block(match: re.Match) -> str:
        return f"{match[1]}\n\n{quote(match['name'])}\n\n{match[4]}"

    def value(match: re.Match) -> str:
        return f"{match[1]}{quote(match['name'])}{match[4]}"

    return VALUE.sub(value, BLOCK.sub(block, text))


def differences() -> list[str]:
    """Unified diffs of every doc whose quotes differ from the results, and of every figure that differs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            name = str(path.relative_to(ROOT))
            found.append(
                "".join(
                    difflib.unified_diff(
                        text.splitlines(True), rendered.splitlines(True), name, f"{name} (from benchmarks/results)"
                    )
                )
            )
    for image, source in FIGURES.items():
        if (ROOT / "docs" / "images" / image).read_bytes() != (RESULTS / source).read_bytes():
            found.append(f"docs/images/{image} differs from benchmarks/results/{source}\n")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where docs and results differ")
    args = parser.parse_args(argv)
    if args.check:
        found = differences()
        print("".join(found) or "The docs quote the results as they are.")
        return 1 if found else 0
    for path in DOCS:
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            path.write_text(rendered)
            print(f"rewrote {path.relative_to(ROOT)}")
    for image, source in FIGURES.items():
        shutil.copy(RESULTS / source, ROOT / "docs" / "images" / image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
