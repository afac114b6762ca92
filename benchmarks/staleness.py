"""Asynchronous training under staleness, at equal sampling budgets: how stale can samples grow before each loss stops
learning, and is the taper what keeps stale negatives safe?

    python benchmarks/staleness.py --plan            # the runs the protocol may train, and their hours
    python benchmarks/staleness.py                   # train what the ledger lacks (resumable), then write the results
    python benchmarks/staleness.py --quick           # smoke run (tests/test_benchmarks.py)

TRL's asynchronous GRPO trainer (`AsyncGRPOTrainer`) trains on samples a worker drew from earlier versions of the
policy. Here the worker is `SamplerRolloutWorker` in the training process, drawing from the policy `lag` versions
(weight syncs, one a step) back, so that staleness is set and reproducible; TRL's pipeline batches one step ahead, so
a sample is trained at staleness lag + 1 (0 + 1 at lag 0). The trainer computes each sample's R - c from its reward
as it does with TRL's own worker. Arms, each on the same prompts and seeds:

- `topr`: [`TOPRAsyncGRPOTrainer`], TOPR's loss with the target positive fraction 0.8, every sample kept;
- `reinforce`: the same R - c with every negative at weight 1 (`loss_type="reinforce"`): stale negatives untapered;
- `tis`: the same R - c with every sample, positive or negative, at clip(pi/mu, 0, 1) (truncated IS);
- `positives_only`: the same trainer with `loss_type="positives_only"` (SFT on the correct samples), every sample kept;
- `trl`: TRL's loss as shipped (token-level PPO clip on GRPO's group-normalised advantages) as its own worker runs it:
  that worker keeps at most `max_staleness=4` versions' worth of samples in flight and makes the trainer wait for a
  slower sampler rather than drop, so at lags past 4 the arm's samples are trained at lag 4 (its lag-4 runs,
  `CAPPED`); its cost there is the waiting, in time, which this benchmark does not measure;
- `trl+keep`: TRL's loss with every sample kept at every lag. At lags 0 and 2 it is `trl`'s runs.

Every step samples fresh prompts (4 prompts x 8 samples) from a pool disjoint from validation and test, none twice in
a run; each run samples the same `budget` of completions and is evaluated on the validation and test prompts (sampled
pass@1, k samples each, per prompt) each time another `every` completions have been sampled: the curve per sampled
completion. Each arm's learning rate is bracketed at lag 0 on seeds 100 and 101 on a ladder of steps of about 2
(`ladder`: 1e-4, 2e-4, 5e-4, ...) until its best is interior (`search.bracket`), the best and its two neighbours are
scored again at the largest lag on the same seeds (whether the best moves), and the rate chosen at lag 0 is held at
every lag and on seeds 0-7, which the readings take (the rates are not chosen on them); `trl+keep` runs at `trl`'s
rate. A run collapsed where its last test sampled pass@1 is below `collapse` (0.5) of its start; every reading prints
how many did. Every finished run (arm, lag, rate, seed) is recorded in `runs/<arm>-lag<k>.jsonl` of --out with the
command and commit that trained it, and never trained again. Writes `results.json`, `table.md` (test sampled pass@1
at each arm's rate, by lag and completions sampled, with the share of the samples each arm dropped) and
`readings.md` (TOPR against each arm at each lag; each arm's gain over its start and its area against its own at lag
0; paired by seed and test prompt, with the seed-level interval beside).
"""

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
from ledger import Ledger
from paired import paired_difference
from provenance import code_version, save, script_command
from search import best_rate, beyond, bracket
from tasks import PRETRAIN_ROWS, pretrain_reverser, reversal_answer, reversal_reward, reversal_rows


ARMS = {
    "topr": {"loss_type": "topr", "target_positive_fraction": 0.8},
    "reinforce": {"loss_type": "reinforce", "target_positive_fraction": 0.8},  # TOPR's R - c, negatives untapered
    "tis": {"loss_type": "tis", "target_positive_fraction": 0.8},  # TOPR's R - c, every sample clip(pi/mu, 0, 1)
    "positives_only": {"loss_type": "positives_only"},
    "trl": {"trl_loss": True, "max_staleness": 4},  # as TRL's worker runs: past its bound it waits (`CAPPED`)
    "trl+keep": {"trl_loss": True},
}
SAME_AS = {("trl+keep", 0): "trl", ("trl+keep", 2): "trl"}  # runs that are another arm's: nothing is dropped there
RATE_OF = {"trl+keep": "trl"}  # an arm held at another's rate
# TRL's own worker keeps at most `max_staleness` versions' worth of samples in flight: a sampler slower than that makes
# the trainer wait for it, and no sample is dropped. At a lag past the bound the arm's samples are trained at the bound
# (its runs at that lag); what it costs is the trainer's waiting, in time, which this benchmark does not measure.
CAPPED = {"trl": 4}
SETTING = {
    "prompts": 4,  # a step's prompts
    "num_samples": 8,
    "budget": 8192,  # completions sampled by a run, dropped ones included
    "every": 1024,  # completions between evaluations
    "val": 64,
    "test": 256,
    "k": 4,
    "max_new_tokens": 12,
    "lags": [0, 2, 8, 32],
    "seeds": 8,  # the seeds of the readings: 0-7
    "sweep_seeds": [100, 101],  # the seeds the rates are chosen on, none of them a seed of the readings
    "start_lr": 1e-4,
    "ladder": [1, 2, 5],  # the rates' leading digits: steps of about 2 (1e-4, 2e-4, 5e-4, 1e-3, ...)
    "collapse": 0.5,  # a run collapsed: its last test sampled pass@1 below this share of its start
    "run_seconds": 60,
    "description": "tiny Llama, reverse 4 digits",
}
# The same benchmark from a start where positives are scarce (sampled pass@1 about 0.02-0.08: 120 SFT steps of the
# reverser, `tasks.pretrain_reverser`), where dropping negatives wastes most of the sampling: `--start scarce`
SCARCE = {"pretrain_steps": 120, "arms": ["topr", "reinforce", "positives_only"], "lags": [0, 8]}
QUICK = {"budget": 64, "every": 32, "val": 8, "test": 8, "lags": [0, 8], "seeds": 2, "sweep_seeds": [100]}


class BudgetSpent(Exception):
    """The run has sampled its budget."""


def setup(work: Path, quick: bool, scarce: bool = False) -> dict:
    """The starting model (the reverser, pretrained once) and the prompts: a training pool, validation and test."""
    from datasets import Dataset

    setting = dict(SETTING, **(SCARCE if scarce else {}), **(QUICK if quick else {}))
    pool = setting["budget"] // setting["num_samples"]  # a run's prompts: each sampled num_samples times
    numbers = random.Random(0).sample(range(10**4), PRETRAIN_ROWS + setting["val"] + setting["test"] + pool)
    model = work / ("start-scarce" if scarce else "start")
    if not (model / "config.json").exists():
        pretrain_reverser(str(model), numbers[:PRETRAIN_ROWS], setting.get("pretrain_steps", 130))
    rows = reversal_rows(numbers[PRETRAIN_ROWS:])
    val, test = rows[: setting["val"]], rows[setting["val"] : setting["val"] + setting["test"]]
    train = rows[setting["val"] + setting["test"] :]
    return dict(setting, model=str(model), train=train, val=Dataset.from_list(val), test=Dataset.from_list(test))


def trainer_class(trl_loss: bool):
    """`TOPRAsyncGRPOTrainer`, or the same trainer with TRL's own loss (TRL's `compute_loss`)."""
    from trl_topr import TOPRAsyncGRPOTrainer
    from trl_topr.async_grpo import AsyncGRPOTrainer  # TRL's class, as the installed TRL has it

    if not trl_loss:
        return TOPRAsyncGRPOTrainer
    return type("TRLLossTrainer", (TOPRAsyncGRPOTrainer,), {"compute_loss": AsyncGRPOTrainer.compute_loss})


def budgeted_worker(base, budget: int):
    """A `SamplerRolloutWorker` that stops the run once it has sampled `budget` completions. Its samples carry GRPO's
    group-normalised advantages, as TRL's own worker's do (what TRL's loss trains), and their rewards (from which
    TOPR's trainer computes R - c)."""

    class Budgeted(base):
        def rollout(self) -> list:
            if self.generated >= budget:
                raise BudgetSpent
            samples = super().rollout()
            self.generated += len(samples)
            return samples

    return Budgeted


def evaluate(setting: dict, model, tokenizer, seed: int) -> dict:
    """Validation and test sampled pass@1 of `model` (k samples a prompt, seeded), with each test prompt's outcome."""
    from trl_topr import Sampler, SamplingSettings

    settings = SamplingSettings(num_samples=setting["k"], max_new_tokens=setting["max_new_tokens"], seed=seed)
    out = {}
    with Sampler(model, tokenizer, progress=False, bf16=False) as sampler:
        for split in ("val", "test"):
            metrics, per_prompt = sampler.evaluate(
                setting[split], reversal_reward, reversal_answer, settings, return_per_prompt=True
            )
            name = "validation" if split == "val" else "test"
            out |= {f"{name}/pass@1": metrics["pass@1"], f"{name}/pass@1_greedy": metrics["pass@1_greedy"]}
            if split == "test":
                out["test/correct"] = [row["correct"] for row in per_prompt]
    return out


def run(setting: dict, arm: str, lr: float, lag: int, seed: int, folder: Path) -> list[dict]:
    """One run: its checkpoints (completions sampled so far and the evaluations; the last with the steps trained and
    the samples dropped)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl_topr import SamplerRolloutWorker, TOPRAsyncGRPOConfig

    options = dict(ARMS[arm])
    trl_loss = options.pop("trl_loss", False)
    batch = setting["prompts"] * setting["num_samples"]
    order = random.Random(seed).sample(setting["train"], len(setting["train"]))  # the seed's prompts, in order
    args = TOPRAsyncGRPOConfig(
        output_dir=str(folder),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        gradient_checkpointing=False,
        seed=seed,
        learning_rate=lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=batch,
        num_generations=setting["num_samples"],
        max_completion_length=setting["max_new_tokens"],
        max_steps=setting["budget"] // batch - 1,  # TRL's loader reads a batch ahead: the last one is never trained
        token_budget=0,
        rollout_lag=lag,
        rollout_prompts=setting["prompts"],
        **options,
    )
    tokenizer = AutoTokenizer.from_pretrained(setting["model"])
    base = budgeted_worker(SamplerRolloutWorker, setting["budget"])
    prompts = Dataset.from_list(order)
    worker = base.from_config(setting["model"], tokenizer, prompts, reversal_reward, args)
    worker.generated = 0
    eval_model = AutoModelForCausalLM.from_pretrained(setting["model"], dtype=torch.float32)
    checkpoints = [{"samples": 0, **evaluate(setting, eval_model, tokenizer, seed)}]

    def checkpoint(trainer) -> None:  # every `every` completions sampled: the policy as it is now
        while worker.generated >= setting["every"] * len(checkpoints):
            eval_model.load_state_dict(trainer.model.state_dict(), strict=False)
            checkpoints.append({"samples": setting["every"] * len(checkpoints)})
            checkpoints[-1] |= evaluate(setting, eval_model, tokenizer, seed)

    class Checkpoints(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            checkpoint(trainer)

    trainer = trainer_class(trl_loss)(setting["model"], reversal_reward, args, prompts, rollout_worker=worker)
    trainer.add_callback(Checkpoints())
    try:
        trainer.train()
    except BudgetSpent:  # a run that drops samples spends its budget before its steps
        pass
    worker.generated = setting["budget"]
    checkpoint(trainer)
    checkpoints[-1] |= {"steps": trainer.state.global_step, "dropped": dropped(trainer)}  # over the whole run
    return checkpoints


def dropped(trainer) -> int:
    """The samples TRL's dataset dropped as too stale so far: those logged, and those in its metrics since the last
    log (a run that drops every sample logs nothing more)."""
    logged = sum(e.get("sample/dropped_stale_total", 0) for e in trainer.state.log_history)
    pending = trainer._metrics["train"].get("sample/dropped_stale_total", [])  # TRL's sink, not yet logged
    return round(logged + sum(pending))


def validation_score(checkpoints: list[dict]) -> dict:
    """The rate criterion: the mean validation sampled pass@1 over the checkpoints after the start (the area under the
    curve per sampled completion), and the last one's."""
    curve = [c["validation/pass@1"] for c in checkpoints[1:]]
    return {"mean": statistics.fmean(curve), "last": curve[-1]}


class Runs:
    """The runs of one call: each trained unless the ledger has it, while time is left, recorded as it finishes."""

    def __init__(self, setting: dict, ledger: Ledger, work: Path, arms: list[str], args):
        self.setting, self.ledger, self.work, self.arms, self.args = setting, ledger, work, arms, args
        self.started, self.trained = time.perf_counter(), 0

    @staticmethod
    def source(arm: str, lag: int) -> tuple[str, int]:
        """The arm and lag whose runs an arm's runs at a lag are: another arm's where they are the same (`SAME_AS`),
        the bound's where its worker waits past it (`CAPPED`)."""
        lag = min(lag, CAPPED.get(arm, lag))
        return SAME_AS.get((arm, lag), arm), lag

    def key(self, arm: str, lag: int) -> str:
        arm, lag = self.source(arm, lag)
        return f"{arm}-lag{lag}"

    def available(self, arm: str, lag: int, lr: float, seed: int) -> bool:
        if self.ledger.get(self.key(arm, lag), lr, seed) is not None:
            return True
        if self.args.report_only or self.source(arm, lag)[0] not in self.arms:
            return False
        limit = self.args.time_limit
        return limit is None or not self.trained or time.perf_counter() - self.started <= 60 * limit

    def run(self, arm: str, lag: int, lr: float, seed: int) -> dict:
        key = self.key(arm, lag)
        if (entry := self.ledger.get(key, lr, seed)) is not None:
            return entry
        started = time.perf_counter()
        folder = self.work / key / f"lr{lr:g}" / f"seed{seed}"
        arm, lag = self.source(arm, lag)
        checkpoints = run(self.setting, arm, lr, lag, seed, folder)
        entry = {
            "method": key,
            "lr": lr,
            "seed": seed,
            "lag": lag,
            "validation": validation_score(checkpoints),
            "seconds": round(time.perf_counter() - started),
            "resumed": False,
            "rounds": checkpoints,
            "command": script_command(__file__, self.args.argv),  # each run with the call that trained it
            **code_version(),
        }
        self.ledger.add(entry)
        self.trained += 1
        curve = " ".join(f"{c['validation/pass@1']:.3f}" for c in checkpoints)
        print(f"{key} lr {lr:g} seed {seed}: validation {curve} ({entry['seconds']} s)", file=sys.stderr, flush=True)
        return entry

    def score(self, arm: str, lr: float, lag: int = 0) -> float | None:
        values = []
        for seed in self.setting["sweep_seeds"]:
            if not self.available(arm, lag, lr, seed):
                return None
            values.append(self.run(arm, lag, lr, seed)["validation"]["mean"])
        return statistics.fmean(values)

    def rates(self, arm: str) -> dict | None:
        """An arm's rates: bracketed at lag 0 on the sweep seeds (steps of the scale's `ladder`) until its best is
        interior, then the best and the rates either side of it scored at the largest lag on the same seeds (does the
        best move?)."""
        ladder = tuple(self.setting["ladder"])
        scores = bracket(self.setting["start_lr"], lambda lr: self.score(arm, lr), ladder=ladder)
        if scores is None:
            return None
        best = best_rate(scores)
        rates = {"best": best, "scores": {f"{k:g}": v for k, v in scores.items()}}
        lag = max(self.setting["lags"])
        near = [beyond(best, up=False, ladder=ladder), best, beyond(best, up=True, ladder=ladder)]
        stale = {rate: self.score(arm, rate, lag) for rate in near}
        if None not in stale.values():
            rates[f"scores_at_lag_{lag}"] = {f"{k:g}": v for k, v in stale.items()}
            rates[f"best_at_lag_{lag}"] = best_rate(stale)
        return rates

    def results(self) -> dict:
        """Each swept arm's rates (`rates`), then every lag and seed at its best rate at lag 0."""
        results = {"arms": {}, "rates": {}}
        for arm in ARMS:
            if arm in RATE_OF:
                continue
            if (rates := self.rates(arm)) is not None:
                results["rates"][arm] = rates
        for arm in ARMS:
            rate = results["rates"].get(RATE_OF.get(arm, arm), {}).get("best")
            if rate is None:
                continue
            for lag in self.setting["lags"]:
                runs = [
                    self.run(arm, lag, rate, seed)
                    for seed in range(self.setting["seeds"])
                    if self.available(arm, lag, rate, seed)
                ]
                results["arms"][f"{arm}@{lag}"] = {
                    "arm": arm,
                    "lag": lag,
                    "lr": rate,
                    "runs": [r["rounds"] for r in runs],
                    **({"trained_lag": self.source(arm, lag)[1]} if arm in CAPPED else {}),
                }
        return results


def plan(setting: dict, ledger: Ledger) -> str:
    """The runs the protocol trains at least (a bracket of three rates per swept arm on the sweep seeds, then every
    lag and seed at the best rate) and their estimated hours."""
    finished = [e["seconds"] for e in ledger.runs.values()]
    each = statistics.fmean(finished) if finished else setting["run_seconds"]
    arms = [arm for arm in ARMS if arm in setting.get("arms", ARMS)]
    swept = [arm for arm in arms if arm not in RATE_OF]
    bracket_runs = 3 * len(setting["sweep_seeds"]) * len(swept)
    check_runs = 2 * len(setting["sweep_seeds"]) * len(swept)  # the best's neighbours at the largest lag
    sources = {Runs.source(arm, lag) for arm in arms for lag in setting["lags"]}
    lag_runs = len(sources) * setting["seeds"]
    total = bracket_runs + check_runs + lag_runs
    hours = max(total - len(ledger.runs), 0) * each / 3600
    return (
        f"At least {total} runs ({bracket_runs} in the brackets at lag 0, {check_runs} checking them at the largest "
        f"lag, {lag_runs} at the best rates), "
        f"{len(ledger.runs)} done, {each / 60:.1f} min a run: {hours:.1f} h to go on one process, about "
        f"{hours / 2:.1f} h on two (--arms split between them, one thread each)"
    )


def collapsed(runs: list[list[dict]], setting: dict) -> str:
    """How many of the runs collapsed (last test sampled pass@1 below `collapse` of its start), "k of n"; "" where the
    protocol does not count them."""
    if "collapse" not in setting:
        return ""
    count = sum(run[-1]["test/pass@1"] < setting["collapse"] * run[0]["test/pass@1"] for run in runs)
    return f"{count} of {len(runs)}"


def curve_table(results: dict, setting: dict) -> str:
    """Test sampled pass@1 at each checkpoint (mean over seeds), by arm and lag, at each arm's rate (with the lag its
    samples were trained at, where its worker waits past a bound, and the runs that collapsed)."""
    marks = list(range(0, setting["budget"] + 1, setting["every"]))
    counted = "collapse" in setting
    extra = " trained at lag | collapsed |" if counted else ""
    lines = ["| arm | lag | rate | seeds | " + " | ".join(str(m) for m in marks) + " | dropped |" + extra]
    lines.append("|---" * (len(marks) + 5 + 2 * counted) + "|")
    for arm in sorted(results["arms"].values(), key=lambda arm: (arm["lag"], arm["arm"])):
        if not arm["runs"]:
            continue
        means = [statistics.fmean(run[i]["test/pass@1"] for run in arm["runs"]) for i in range(len(marks))]
        dropped = statistics.fmean(run[-1]["dropped"] / setting["budget"] for run in arm["runs"])
        cells = " | ".join(f"{m:.3f}" for m in means)
        line = f"| {arm['arm']} | {arm['lag']} | {arm['lr']:g} | {len(arm['runs'])} | {cells} | {dropped:.0%} |"
        if counted:
            line += f" {arm.get('trained_lag', arm['lag'])} | {collapsed(arm['runs'], setting)} |"
        lines.append(line)
    return "\n".join(lines)


def arm_runs(results: dict, arm: str, lag: int) -> list[list[dict]]:
    return results["arms"].get(f"{arm}@{lag}", {"runs": []})["runs"]


def learning(results: dict, setting: dict) -> str:
    """How stale samples can grow before each loss stops learning: each arm's test sampled pass@1 at the last
    checkpoint minus at the start ("above": it learned), and its area at each lag minus its own at lag 0 ("below":
    staleness cost it), paired by seed and test prompt, with the seed-level interval; a reading only where both
    exclude 0."""
    counted = "collapse" in setting
    lines = ["| arm | lag | seeds | last minus start | learned | area minus lag 0's | against lag 0 |"]
    lines = [lines[0] + " collapsed |"] if counted else lines
    lines.append("|---" * (7 + counted) + "|")
    for arm in ARMS:
        fresh = arm_runs(results, arm, 0)
        for lag in setting["lags"]:
            runs = arm_runs(results, arm, lag)
            if len(runs) < 2 or (arm, lag) in SAME_AS:
                continue
            count = len(runs[0])
            gain = paired_difference(runs, [[run[0]] * count for run in runs], [count - 1], setting["k"])
            cells = ["", ""]
            if lag and len(fresh) >= len(runs):
                cost = paired_difference(runs, fresh[: len(runs)], list(range(1, count)), setting["k"])
                cells = [cost.text(), cost.reading]
            cells += [collapsed(runs, setting)] if counted else []
            lines.append(
                f"| {arm} | {lag} | {len(runs)} | {gain.text()} | {gain.reading} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def readings(results: dict, setting: dict) -> str:
    """TOPR against each other arm at each lag: the paired difference of test sampled pass@1 over the checkpoints
    after the start (area) and at the last, with the seed-level interval; "above" only where both exclude 0."""
    counted = "collapse" in setting
    lines = ["| lag | TOPR minus | seeds | area | area reading | last | last reading |"]
    lines = [lines[0] + " collapsed, TOPR | collapsed, the other |"] if counted else lines
    lines.append("|---" * (7 + 2 * counted) + "|")
    for lag in setting["lags"]:
        topr = arm_runs(results, "topr", lag)
        for other in [arm for arm in ARMS if arm != "topr"]:
            runs = arm_runs(results, other, lag)
            seeds = min(len(topr), len(runs))
            if seeds < 2:
                continue
            count = len(topr[0])
            area = paired_difference(topr[:seeds], runs[:seeds], list(range(1, count)), setting["k"])
            last = paired_difference(topr[:seeds], runs[:seeds], [count - 1], setting["k"])
            line = f"| {lag} | {other} | {seeds} | {area.text()} | {area.reading} | {last.text()} | {last.reading} |"
            if counted:
                line += f" {collapsed(topr[:seeds], setting)} | {collapsed(runs[:seeds], setting)} |"
            lines.append(line)
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="the arms to train (default: all)")
    parser.add_argument(
        "--start",
        choices=["middling", "scarce"],
        default="middling",
        help="the starting model: sampled pass@1 about 0.1-0.4 (default), or scarce positives, about 0.02-0.08 "
        "(`SCARCE`: its arms and lags, results in benchmarks/results/staleness-scarce)",
    )
    parser.add_argument("--work", help="unfinished runs (default: outputs/staleness[-quick])")
    parser.add_argument("--out", help="results (default: benchmarks/results/staleness-v2)")
    parser.add_argument("--time_limit", type=float, help="minutes: stop after the run that crosses it")
    parser.add_argument("--report_only", action="store_true", help="write the finished runs' results, train nothing")
    parser.add_argument("--plan", action="store_true", help="print the runs and their hours, train nothing")
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    args.argv = argv  # what each run records of the call that trained it
    scarce = args.start == "scarce"
    suffix = ("-scarce" if scarce else "") + ("-quick" if args.quick else "")
    work = Path(args.work or ROOT / "outputs" / f"staleness{suffix}")
    default = "benchmarks/results/staleness-scarce" if scarce else "benchmarks/results/staleness-v2"
    out = Path(args.out or ROOT / (f"outputs/staleness{suffix}-results" if args.quick else default))
    started = time.time()
    ledger = Ledger(out)
    setting = dict(SETTING, **(SCARCE if scarce else {}), **(QUICK if args.quick else {}))
    arms = [arm for arm in ARMS if arm in setting.get("arms", ARMS)]
    if args.plan:
        text = plan(setting, ledger)
        print(text)
        return text
    work.mkdir(parents=True, exist_ok=True)
    setting = setup(work, args.quick, scarce)
    runs = Runs(setting, ledger, work, [arm for arm in args.arms or arms if arm in arms], args)
    results = runs.results()
    results["title"] = (
        f"{setting['description']}{', positives scarce at the start' if scarce else ''}: {setting['prompts']} "
        f"fresh prompts x {setting['num_samples']} samples a step, "
        f"{setting['budget']} completions sampled a run, evaluated every {setting['every']}"
    )
    results["settings"] = {
        k: v for k, v in setting.items() if isinstance(v, (int, float, str, list)) and k not in ("train", "model")
    }  # the starting model's folder is this machine's
    complete = all(len(a["runs"]) == setting["seeds"] for a in results["arms"].values()) and len(
        results["arms"]
    ) == len(arms) * len(setting["lags"])
    table, read = curve_table(results, setting), readings(results, setting)
    learned = learning(results, setting)
    files = {
        "results.json": results,
        "table.md": f"{results['title']}\n\n{table}\n",
        "readings.md": f"{results['title']}\n\n{read}\n\n{learned}\n",
    }
    out.mkdir(parents=True, exist_ok=True)
    save(out, files, script=__file__, argv=argv, started=started, append=True)
    status = "complete" if complete else "not finished: run the same command again to go on"
    print(f"{results['title']}; {status}\n\n{table}\n\n{read}\n\n{learned}")
    return table


if __name__ == "__main__":
    main()
