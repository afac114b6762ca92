"""The iterative benchmark's ledger: every finished run (arm, learning rate, seed) with its rounds and its score,
committed with the results so that a run finished anywhere is never trained again."""

import json
import statistics
import sys
from pathlib import Path

from arms import ARMS


class Ledger:
    """The finished runs, one JSON line each in `runs/<method>.jsonl` of the results folder: the method, rate and seed,
    the validation scores, the seconds it took (`resumed`: of the call that finished it) and its rounds (`read_run`).
    Committed with the results, so a run finished anywhere is never trained again, and calls with different methods
    write different files."""

    def __init__(self, folder: Path):
        self.folder = folder / "runs"
        self.runs = {}
        for path in sorted(self.folder.glob("*.jsonl")):
            lines = path.read_text().splitlines()
            for number, line in enumerate(lines, start=1):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    if number < len(lines):
                        raise
                    print(
                        f"{path}: the last line is cut short (a call stopped while writing it): its run will be "
                        "trained again",
                        file=sys.stderr,
                    )
                    continue
                self.runs[entry["method"], f"{entry['lr']:g}", entry["seed"]] = entry

    def get(self, method: str, lr: float, seed: int) -> dict | None:
        return self.runs.get((method, f"{lr:g}", seed))

    def add(self, entry: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{entry['method']}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        self.runs[entry["method"], f"{entry['lr']:g}", entry["seed"]] = entry

    def rates(self, method: str) -> list[float]:
        return sorted({entry["lr"] for (m, _, _), entry in self.runs.items() if m == method})


def per_prompt_lists(per_prompt: list[dict]) -> dict[str, list[int]]:
    """Each test prompt's outcome, as the ledger keeps it: `correct` (how many of its k samples are correct) and
    `greedy_correct` (0 or 1), one entry per prompt in the split's order, for paired comparisons over prompts."""
    return {key: [row[key] for row in per_prompt] for key in ("correct", "greedy_correct")}


def read_run(method: str, folder: Path) -> list[dict]:
    """A run's rounds: held-out metrics (`validation/...` every round, `test/...` at the test rounds, with each test
    prompt's outcome: `test/correct`, `test/greedy_correct`), what was sampled so far, and (loop methods) the trainer's
    per-round means."""
    metrics_file = folder / "metrics.jsonl"
    rounds = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    tests = folder / "test.jsonl"
    for line in tests.read_text().splitlines() if tests.exists() else []:
        test = json.loads(line)
        rounds[test.pop("round")].update({f"test/{key}": value for key, value in test.items()})
    for r in rounds:  # the test split evaluated with the held-out splits (the loop's and GRPO's evaluation files)
        evaluation = folder / f"round-{r['round']}" / "evaluation-test.jsonl"
        if evaluation.exists():
            rows = [json.loads(line) for line in evaluation.read_text().splitlines()]
            r.update({f"test/{key}": value for key, value in per_prompt_lists(rows).items()})
    sampled, tokens = 0, 0
    for r in rounds:
        if r["round"] > 0 and not ARMS[method].online:
            samples = [json.loads(line) for line in (folder / f"round-{r['round']}" / "samples.jsonl").open()]
            r["num_tokens"] = sum(len(s["completion_ids"]) for s in samples)
            log = json.loads((folder / f"round-{r['round']}" / "trainer_state.json").read_text())["log_history"]
            steps = [h for h in log if "negative_weight_share" in h or "negative_weight_mean" in h]
            for key in (
                "negative_weight_mean",
                "negative_tapered_fraction",
                "negative_weight_share",
                "log_ratio_mean",
                "log_ratio_min",
                "effective_positive_fraction",
                "clamped_fraction",
                "effective_sample_size",
            ):
                values = [h[key] for h in steps if key in h]
                r[f"train/{key}"] = statistics.fmean(values) if values else float("nan")
        sampled += r.get("num_samples", 0)
        tokens += r.get("num_tokens", 0)
        r["sampled_completions"], r["sampled_tokens"] = sampled, round(tokens)
    return rounds


def validation_scores(rounds: list[dict]) -> dict:
    """The rate criterion of a run: the mean of its validation sampled pass@1 over rounds 1..R (`mean`, the area
    under its learning curve against completions sampled, every round sampling as many), and after the last round
    (`last`, what a user has after spending every sample)."""
    curve = [r["validation/pass@1"] for r in rounds[1:]]
    return {"mean": statistics.fmean(curve), "last": curve[-1], "greedy_last": rounds[-1]["validation/pass@1_greedy"]}
