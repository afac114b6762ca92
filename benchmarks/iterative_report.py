"""The iterative benchmark's tables and plot, from its results (`results.json`) and its ledger: what
`benchmarks/iterative.py` writes next to the results, and what `benchmarks/report.py` reads."""

import statistics
from pathlib import Path

from arms import ARMS


def mean_std(values: list[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return ""
    return f"{statistics.fmean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def at(r: dict, key: str) -> float:
    """A round's test metric: `test/<key>`, or `<key>` in results recorded before the validation split was evaluated
    every round (the test split was then the loop's only held-out set); NaN where the round was not tested."""
    return r.get(f"test/{key}", r.get(key, float("nan")))


def complete(entry: dict, rounds: int) -> list[list[dict]]:
    return [run for run in entry["runs"] if len(run) == rounds + 1]


def summarize(results: dict) -> tuple[str, str]:
    """Markdown: test sampled pass@1 per round (mean ± standard deviation over seeds) at each arm's chosen rate, with
    the validation criterion and the last round's greedy pass@1 and invalid rate; and the diagnosis of the loop
    methods' training rounds."""
    rounds = results["settings"]["rounds"]
    tested = [run for e in results["methods"].values() for run in complete(e, rounds)]
    sampled = [r for r in range(rounds + 1) if any(at(run[r], "pass@1") == at(run[r], "pass@1") for run in tested)]
    header = [
        "method",
        "lr",
        "seeds",
        "validation mean",
        *[f"r{r}" for r in sampled],
        "greedy",
        "invalid",
        "completions",
    ]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    diagnosis_header = [
        "method",
        "round",
        "positive fraction",
        "effective positive fraction",
        "negative weight share",
        "negative weight mean",
        "tapered negatives",
        "log ratio mean",
        "log ratio min",
    ]
    diagnosis = ["| " + " | ".join(diagnosis_header) + " |", "|" + "---|" * len(diagnosis_header)]
    for method, entry in results["methods"].items():
        runs = complete(entry, rounds)
        if not runs:
            continue
        criterion = mean_std([v["mean"] for v in entry["validation"] if "mean" in v])
        cells = [
            method,
            f"{entry['lr']:g}",
            str(len(runs)),
            criterion,
            *[mean_std([at(run[r], "pass@1") for run in runs]) for r in sampled],
            mean_std([at(run[-1], "pass@1_greedy") for run in runs]),
            mean_std([at(run[-1], "invalid_rate") for run in runs]),
            str(runs[0][-1]["sampled_completions"]),
        ]
        table.append("| " + " | ".join(cells) + " |")
        if ARMS[method].online:
            continue
        for r in range(1, rounds + 1):

            def cell(key: str, r: int = r, runs: list = runs) -> str:
                return mean_std([run[r].get(key, float("nan")) for run in runs])

            diagnosis.append(
                "| "
                + " | ".join(
                    [
                        method,
                        str(r),
                        cell("positive_fraction"),
                        cell("effective_positive_fraction"),
                        cell("train/negative_weight_share"),
                        cell("train/negative_weight_mean"),
                        cell("train/negative_tapered_fraction"),
                        cell("train/log_ratio_mean"),
                        cell("train/log_ratio_min"),
                    ]
                )
                + " |"
            )
    per_round = results["settings"]["prompts"] * results["settings"]["num_samples"]
    note = (
        f"\n\nTest split, sampled pass@1 after round r (r0 = the starting model; each round samples {per_round} "
        "completions), mean ± standard deviation over seeds; greedy and invalid: after the last round. lr: the "
        "rate of the sweep with the highest validation mean (sampled pass@1 on the validation split averaged "
        "over rounds 1..R, mean over the sweep seeds)."
    )
    return "\n".join(table) + note, "\n".join(diagnosis)


def efficiency_table(results: dict) -> str:
    """Markdown: for every arm at its chosen rate, the completions sampled until each seed's test sampled pass@1 first
    reaches each threshold ("-": never within the run), seed by seed. The thresholds are the scale's `thresholds`,
    or its start plus each of its `gains` (the start: the starting model's test sampled pass@1, the mean over every
    run), as a scale whose model starts low is judged by what it gains."""
    settings = results["settings"]
    rounds = settings["rounds"]
    thresholds = [(t, f"to {t:g}") for t in settings.get("thresholds") or []]
    if settings.get("gains"):
        start = statistics.fmean(
            at(run[0], "pass@1") for entry in results["methods"].values() for run in complete(entry, rounds)
        )
        thresholds = [(start + g, f"to {start + g:.3f} (start + {g:g})") for g in settings["gains"]]
    header = ["method", "lr", *[f"{label} (by seed)" for _, label in thresholds]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, entry in results["methods"].items():
        runs = complete(entry, rounds)
        if runs:
            cells = [" / ".join(str(first_reaching(run, t) or "-") for run in runs) for t, _ in thresholds]
            lines.append("| " + " | ".join([method, f"{entry['lr']:g}", *cells]) + " |")
    return "\n".join(lines) + "\n\nCompletions sampled when the test sampled pass@1 first reached the threshold."


def first_reaching(run: list[dict], threshold: float) -> int | None:
    """Completions sampled by the first round whose test sampled pass@1 is at least `threshold`, or None."""
    return next((r["sampled_completions"] for r in run if at(r, "pass@1") >= threshold), None)


def sweep_table(ledger, setting: dict) -> str:
    """Markdown: every rate scored by a sweep (the sweep seeds' runs): the validation criterion that picks the rate
    (the mean over rounds 1..R) and each seed's, the validation score after the last round, and the test sampled
    pass@1 per round (mean ± standard deviation over the seeds). For the replay arms, every rate of their grid: the
    same-rate table."""
    rounds = [r for r in range(setting["rounds"] + 1) if setting["test_rounds"] is None or r in setting["test_rounds"]]
    header = [
        "method",
        "lr",
        "seeds",
        "validation mean",
        "by seed",
        "validation last",
        *[f"test r{r}" for r in rounds],
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in ARMS:
        for lr in ledger.rates(method):
            entries = [e for seed in range(setting["sweep_seeds"]) if (e := ledger.get(method, lr, seed)) is not None]
            if not entries:
                continue
            means = [e["validation"]["mean"] for e in entries]
            cells = [
                method,
                f"{lr:g}",
                str(len(entries)),
                mean_std(means),
                " / ".join(f"{v:.3f}" for v in means),
                mean_std([e["validation"]["last"] for e in entries]),
                *[mean_std([at(e["rounds"][r], "pass@1") for e in entries]) for r in rounds],
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\nSeeds 0-{setting['sweep_seeds'] - 1}; validation mean: sampled pass@1 on the "
        "validation split averaged over rounds 1..R; last: after round R; test: sampled pass@1 "
        "on the test split after round r."
    )


def ages_table(results: dict) -> str:
    """Markdown: the replay arms' metrics by sample age at the start of each round (mean over seeds): rows, mean and
    min log-ratio log pi - log mu, mean ratio before truncation, fraction of negatives tapered below 0.99, and the
    age's share of the weight x |R - c|."""
    keys = ["rows", "log_ratio_mean", "log_ratio_min", "ratio_mean", "negative_tapered_fraction", "weight_share"]
    header = ["method", "round", "age", *[k.replace("_", " ") for k in keys]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, entry in results["methods"].items():
        runs = [run for run in entry["runs"] if len(run) == results["settings"]["rounds"] + 1]
        for r in range(1, results["settings"]["rounds"] + 1):
            for age in range(entry["replay_rounds"] + 1 if entry["replay_rounds"] and runs else 0):
                if f"age_{age}/rows" not in runs[0][r]:
                    continue
                cells = [mean_std([run[r].get(f"age_{age}/{k}", float("nan")) for run in runs]) for k in keys]
                lines.append("| " + " | ".join([method, str(r), str(age), *cells]) + " |")
    return "\n".join(lines) + "\n\nMean ± standard deviation over seeds; age k: sampled k rounds before."


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("pass@1", "test sampled pass@1"),
        ("pass@1_greedy", "test greedy pass@1"),
        ("invalid_rate", "test invalid rate (samples)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for method, entry in results["methods"].items():
        runs = complete(entry, results["settings"]["rounds"])
        if not runs:
            continue
        style = (
            {"linewidth": 2.5, "color": "black"}
            if method.startswith("topr") and "_" not in method
            else {"linewidth": 1.2}
        )
        style["linestyle"] = "--" if ARMS[method].replay else "-"
        for ax, (key, title) in zip(axes, panels):
            points = [
                (run_round["sampled_completions"], [at(run[i], key) for run in runs])
                for i, run_round in enumerate(runs[0])
                if at(run_round, key) == at(run_round, key)
            ]
            x = [p[0] for p in points]
            means = [statistics.fmean(v) for _, v in points]
            spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in points]
            ax.errorbar(x, means, yerr=spread, marker="o", capsize=3, label=f"{method} (lr {entry['lr']:g})", **style)
            ax.set_title(title)
            ax.set_xlabel("completions sampled so far")
    axes[0].legend(fontsize=7)
    fig.suptitle(results["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
