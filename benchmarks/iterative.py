"""Iterative training at equal sampling budgets, the paper's regime: sample with the current model, train one epoch,
repeat. TOPR against positives-only (RFT/STaR), REINFORCE, TOPR with a target positive fraction (0.5, 0.8), TOPR on
Anna Karenina-curated rounds, and TRL's GRPOTrainer online on the same prompts and reward.

    python benchmarks/iterative.py --scale fast            # tiny Llama, digit reversal: under 30 minutes on 2 CPU cores
    python benchmarks/iterative.py --scale real            # SmolLM2-135M-Instruct, single-digit arithmetic: hours
    python benchmarks/iterative.py --scale fast --quick    # smoke run (tests/test_benchmarks.py)

Every run (method, learning rate, seed) is saved round by round under --work: run the command again to go on where it
stopped (`--time_limit` stops cleanly after that many minutes). Every method first gets a small learning-rate sweep on
one seed, scored on a validation split (sampled pass@1 after the last round), climbing the grid from its smallest rate
and stopping at the first rate that scores below a smaller one; while the best is at an edge of the rates scored, the
next rate past it is scored too (up to two beyond the grid); then each method's best rate runs the other seeds.
The reported numbers are on a separate test split.

- Loop methods (`run_topr_loop`, one epoch per round, a fresh optimizer each round): each round samples
  `num_samples` completions of every training prompt with the current model (mu = that model), scores them +1 / -1,
  trains one epoch, evaluates on the test split.
- GRPO (TRL's `GRPOTrainer`, online): the same prompts, `num_generations = num_samples`, the same completions per
  optimizer step as the loop's batch; one pass over the prompts samples as many completions as one loop round and is
  evaluated as one round.

The x axis is what was sampled so far (completions and completion tokens), the same for every method. Writes
`results.json`, `table.md`, `diagnosis.md`, `sweep.md` (every finished seed-0 run) and `iterative.png` to --out
(default benchmarks/results/iterative-<scale>).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import save  # noqa: E402

# name -> TOPRConfig options of a loop method, or None for GRPO
METHODS = {
    "topr": {"loss_type": "topr"},
    "topr_peff0.5": {"loss_type": "topr", "target_positive_fraction": 0.5},
    "topr_peff0.8": {"loss_type": "topr", "target_positive_fraction": 0.8},
    "positives_only": {"loss_type": "positives_only"},
    "reinforce": {"loss_type": "reinforce"},
    "topr_anna_karenina": {"loss_type": "topr"},  # and the rounds curated with `anna_karenina`
    "grpo": None,
}
SCALES = {
    # prompts: training prompts sampled every round, val / test: held-out prompts, k: samples per held-out prompt
    "fast": {"prompts": 64, "num_samples": 8, "val": 64, "test": 128, "k": 4, "rounds": 8, "seeds": 3, "batch": 16,
             "lrs": [3e-5, 1e-4, 3e-4, 1e-3], "max_new_tokens": 12, "bf16": False},
    "real": {"prompts": 48, "num_samples": 4, "val": 48, "test": 96, "k": 4, "rounds": 4, "seeds": 3, "batch": 8,
             "lrs": [3e-6, 1e-5, 3e-5, 1e-4], "max_new_tokens": 48, "bf16": None},  # None: bf16 where the CPU has it natively
}
QUICK = {"prompts": 8, "num_samples": 4, "val": 4, "test": 4, "k": 1, "rounds": 2, "seeds": 2, "batch": 8,
         "lrs": [3e-4]}


# ---------------------------------------------------------------------------------------------------------------- tasks
def setup(scale: str, work: Path, quick: bool) -> dict:
    """The starting model, the prompts (train / validation / test) and the task's functions."""
    from datasets import Dataset

    settings = dict(SCALES[scale], **(QUICK if quick else {}))
    splits = (settings["prompts"], settings["val"], settings["test"])
    if scale == "fast":
        from learning import PRETRAIN_ROWS, pretrain_reverser, reversal_answer, reversal_reward, reversal_rows

        numbers = random.Random(0).sample(range(10**4), PRETRAIN_ROWS + sum(splits))
        model = work / "start"
        if not (model / "config.json").exists():  # the behavior policy of round 1, built once
            pretrain_reverser(str(model), numbers[:PRETRAIN_ROWS])
        rows = reversal_rows(numbers[PRETRAIN_ROWS:])
        task = {"reward": reversal_reward, "answer": reversal_answer, "description": "tiny Llama, reverse 4 digits"}
    else:
        sys.path.insert(0, str(ROOT / "recipes"))
        from gsm8k import arithmetic_problems, few_shot_prompts

        from trl_topr.embedded import smollm2_path
        from trl_topr.rewards import extract_final_answer, gsm8k_reward

        problems = arithmetic_problems(0)  # the 243 single-digit questions; the first is the one-shot example
        model, rows = smollm2_path(), list(few_shot_prompts(problems[1:], problems[:1]))
        task = {"reward": gsm8k_reward, "answer": extract_final_answer,
                "description": "SmolLM2-135M-Instruct, single-digit 'What is a op b?', one-shot"}  # fmt: skip
    train, val = rows[: splits[0]], rows[splits[0] : splits[0] + splits[1]]
    test = rows[splits[0] + splits[1] : sum(splits)]
    return dict(settings, model=str(model), train=Dataset.from_list(train), val=Dataset.from_list(val),
                test=Dataset.from_list(test), **task)  # fmt: skip


def training_args(setting: dict, out: Path, lr: float, seed: int, **overrides) -> dict:
    from trl_topr.config import CHECKPOINTING  # the name of the transformers installed (vLLM's pins an older one)
    from trl_topr.precision import resolve_bf16

    return {
        "output_dir": str(out), "use_cpu": True, "bf16": resolve_bf16(setting["bf16"], use_cpu=True),
        "report_to": "none", "seed": seed, "learning_rate": lr, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "per_device_train_batch_size": setting["batch"],
        "logging_steps": 1, "save_strategy": "no", CHECKPOINTING: False, "disable_tqdm": True,
        **overrides,
    }  # fmt: skip


def sampling(setting: dict, seed: int | None = None) -> dict:
    kwargs = {"temperature": 1.0, "top_k": 0, "max_new_tokens": setting["max_new_tokens"], "batch_size": 32}
    return kwargs if seed is None else {**kwargs, "seed": seed}


# ------------------------------------------------------------------------------------------------------------ the runs
def run_loop(method: str, setting: dict, lr: float, seed: int, folder: Path, use_vllm: bool) -> None:
    """Go on with a loop method's run (the loop resumes after its last completed round), then delete all but the last
    round's weights."""
    from trl_topr import TOPRConfig, anna_karenina, run_topr_loop
    from trl_topr.generation import SamplingSettings

    args = TOPRConfig(**training_args(setting, folder, lr, seed, use_vllm=use_vllm), **METHODS[method])
    run_topr_loop(
        setting["model"], setting["train"], setting["reward"], args, num_rounds=setting["rounds"],
        eval_prompts=setting["test"], correct_func=setting["reward"], answer_func=setting["answer"],
        curate=anna_karenina if method == "topr_anna_karenina" else None,
        sampling=SamplingSettings(num_samples=setting["num_samples"], **sampling(setting)),
        eval_sampling=SamplingSettings(num_samples=setting["k"], **sampling(setting, seed)), progress=False,
    )  # fmt: skip
    for old in folder.glob("round-*/model*.safetensors"):
        if old.parent.name != f"round-{setting['rounds']}":
            old.unlink()


def run_grpo(setting: dict, lr: float, seed: int, folder: Path) -> None:
    """Go on with TRL's GRPOTrainer, one pass over the prompts (one loop round's worth of samples) at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_topr import evaluate_policy

    steps_per_round = setting["prompts"] * setting["num_samples"] // setting["batch"]
    metrics_file = folder / "metrics.jsonl"
    evaluated = len(metrics_file.read_text().splitlines()) if metrics_file.exists() else 0  # rounds 0, 1, ...

    def evaluate(model, tokenizer, round_index: int, extra: dict) -> None:
        metrics = evaluate_policy(model, tokenizer, setting["test"], setting["reward"], setting["answer"],
                                  num_samples=setting["k"], progress=False, **sampling(setting, seed))  # fmt: skip
        with open(metrics_file, "a") as f:
            f.write(json.dumps({"round": round_index, **extra, **metrics}) + "\n")

    folder.mkdir(parents=True, exist_ok=True)
    if not evaluated:  # round 0: the starting model
        start = setting["model"]
        evaluate(AutoModelForCausalLM.from_pretrained(start), AutoTokenizer.from_pretrained(start), 0, {})
        evaluated = 1
    for round_index in range(evaluated, setting["rounds"] + 1):
        args = GRPOConfig(**training_args(
            setting, folder, lr, seed, max_steps=round_index * steps_per_round, save_strategy="steps",
            save_steps=steps_per_round, save_total_limit=1, num_generations=setting["num_samples"],
            max_completion_length=setting["max_new_tokens"], temperature=1.0, top_k=0, beta=0.0,
        ))  # fmt: skip
        trainer = GRPOTrainer(setting["model"], reward_funcs=setting["reward"], args=args,
                              train_dataset=setting["train"])  # fmt: skip
        trainer.remove_callback(PrinterCallback)
        trainer.train(resume_from_checkpoint=round_index > 1)
        logs = [h for h in trainer.state.log_history if "reward" in h][-steps_per_round:]
        samples = steps_per_round * setting["batch"]
        extra = {"reward": statistics.fmean(h["reward"] for h in logs), "num_samples": samples,
                 "num_tokens": samples * statistics.fmean(h["completions/mean_length"] for h in logs)}  # fmt: skip
        evaluate(trainer.model, trainer.processing_class, round_index, extra)


def read_run(method: str, folder: Path) -> list[dict]:
    """A run's rounds: held-out metrics, what was sampled so far, and (loop methods) the trainer's per-round means."""
    metrics_file = folder / "metrics.jsonl"
    rounds = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    sampled, tokens = 0, 0
    for r in rounds:
        if r["round"] > 0 and method != "grpo":
            samples = [json.loads(line) for line in (folder / f"round-{r['round']}" / "samples.jsonl").open()]
            r["num_tokens"] = sum(len(s["completion_ids"]) for s in samples)
            log = json.loads((folder / f"round-{r['round']}" / "trainer_state.json").read_text())["log_history"]
            steps = [h for h in log if "negative_weight_share" in h or "negative_weight_mean" in h]
            for key in ("negative_weight_mean", "negative_tapered_fraction", "negative_weight_share",
                        "log_ratio_mean", "log_ratio_min", "effective_positive_fraction"):  # fmt: skip
                values = [h[key] for h in steps if key in h]
                r[f"train/{key}"] = statistics.fmean(values) if values else float("nan")
        sampled += r.get("num_samples", 0)
        tokens += r.get("num_tokens", 0)
        r["sampled_completions"], r["sampled_tokens"] = sampled, round(tokens)
    return rounds


# -------------------------------------------------------------------------------------------------------------- report
def mean_std(values: list[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return ""
    return f"{statistics.fmean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def summarize(results: dict) -> tuple[str, str]:
    """Markdown: held-out greedy pass@1 per round (mean ± standard deviation over seeds) with the final sampled pass@1
    and invalid rate; and the diagnosis of the loop methods' training rounds."""
    rounds = results["settings"]["rounds"]
    header = ["method", "lr", "seeds", *[f"greedy r{r}" for r in range(rounds + 1)], "sampled", "invalid",
              "completions", "tokens"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    diagnosis_header = ["method", "round", "positive fraction", "effective positive fraction", "negative weight share",
                        "negative weight mean", "tapered negatives", "log ratio mean", "log ratio min"]  # fmt: skip
    diagnosis = ["| " + " | ".join(diagnosis_header) + " |", "|" + "---|" * len(diagnosis_header)]
    for method, entry in results["methods"].items():
        runs = [run for run in entry["runs"] if len(run) == rounds + 1]
        if not runs:
            continue
        last = lambda key: mean_std([run[-1].get(key, float("nan")) for run in runs])  # noqa: E731
        cells = [method, f"{entry['lr']:g}", str(len(runs)), *[mean_std([run[r]["pass@1_greedy"] for run in runs])
                                               for r in range(rounds + 1)],
                 last("pass@1"), last("invalid_rate"), str(runs[0][-1]["sampled_completions"]),
                 str(round(statistics.fmean(run[-1]["sampled_tokens"] for run in runs)))]  # fmt: skip
        table.append("| " + " | ".join(cells) + " |")
        if method == "grpo":
            continue
        for r in range(1, rounds + 1):
            at = lambda key: mean_std([run[r].get(key, float("nan")) for run in runs])  # noqa: E731
            diagnosis.append("| " + " | ".join([
                method, str(r), at("positive_fraction"), at("effective_positive_fraction"),
                at("train/negative_weight_share"), at("train/negative_weight_mean"),
                at("train/negative_tapered_fraction"), at("train/log_ratio_mean"), at("train/log_ratio_min"),
            ]) + " |")  # fmt: skip
    note = ("\n\nTest split, mean ± standard deviation over seeds; r0 = the starting model. lr: the best of the "
            "sweep on the validation split (sampled pass@1).")
    return "\n".join(table) + note, "\n".join(diagnosis)


def sweep_table(work: Path, methods: list[str], rounds: int) -> str:
    """Markdown: every finished seed-0 run (the sweeps, complete or not): held-out greedy pass@1 per round, the final
    sampled pass@1 and invalid rate, and the validation score that picks the rate."""
    header = ["method", "lr", *[f"greedy r{r}" for r in range(rounds + 1)], "sampled", "invalid", "validation"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        done = {float(d.parent.parent.name[2:]): d for d in (work / method).glob("lr*/seed0/done")}
        for lr in sorted(done):
            run = read_run(method, done[lr].parent)
            validation = json.loads(done[lr].read_text())["pass@1"]
            cells = [method, f"{lr:g}", *[f"{r['pass@1_greedy']:.3f}" for r in run],
                     f"{run[-1]['pass@1']:.3f}", f"{run[-1]['invalid_rate']:.3f}", f"{validation:.3f}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nSeed 0, test split; validation: sampled pass@1 on the validation split."


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("pass@1_greedy", "held-out greedy pass@1"), ("pass@1", "held-out sampled pass@1"),
              ("invalid_rate", "held-out invalid rate (samples)")]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for method, entry in results["methods"].items():
        runs = [run for run in entry["runs"] if len(run) == results["settings"]["rounds"] + 1]
        if not runs:
            continue
        x = [r["sampled_completions"] for r in runs[0]]
        style = {"linewidth": 2.5, "color": "black"} if method == "topr" else {"linewidth": 1.2}
        for ax, (key, title) in zip(axes, panels):
            values = [[run[r][key] for run in runs] for r in range(len(x))]
            means = [statistics.fmean(v) for v in values]
            spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            ax.errorbar(x, means, yerr=spread, marker="o", capsize=3, label=f"{method} (lr {entry['lr']:g})", **style)
            ax.set_title(title)
            ax.set_xlabel("completions sampled so far")
    axes[0].legend(fontsize=8)
    fig.suptitle(results["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# ---------------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SCALES), default="fast")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--work", help="runs, resumable (default: outputs/iterative-<scale>[-quick])")
    parser.add_argument("--out", help="results (default: benchmarks/results/iterative-<scale>, "
                                      "outputs/iterative-<scale>-results-quick with --quick)")
    parser.add_argument("--time_limit", type=float, help="minutes: stop after the run that crosses it")
    parser.add_argument("--report_only", action="store_true", help="write the finished runs' results, train nothing")
    parser.add_argument("--use_vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="sample the loop methods with vLLM (default: at the real scale, where vLLM is installed)")
    args = parser.parse_args(argv)
    suffix = f"{args.scale}{'-quick' if args.quick else ''}"
    work = Path(args.work or ROOT / "outputs" / f"iterative-{suffix}")
    out = Path(args.out or ROOT / (f"outputs/iterative-{args.scale}-results-quick" if args.quick
                                   else f"benchmarks/results/iterative-{args.scale}"))  # fmt: skip
    started = time.time()
    if args.use_vllm is None:
        import importlib.util

        args.use_vllm = args.scale == "real" and importlib.util.find_spec("vllm") is not None
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    setting = setup(args.scale, work, args.quick)
    results = {"methods": {}}
    ran = []  # the runs this call trained (the time limit stops after at least one)

    def run(method: str, lr: float, seed: int) -> list[dict]:
        folder = work / method / f"lr{lr:g}" / f"seed{seed}"
        if not (folder / "done").exists():
            started = time.perf_counter()
            if method == "grpo":
                run_grpo(setting, lr, seed, folder)
            else:
                run_loop(method, setting, lr, seed, folder, args.use_vllm)
            ran.append(folder)
            scores = validate(setting, method, folder, seed)  # the run's seconds: its cost, whatever the pieces
            (folder / "done").write_text(json.dumps({**scores, "seconds": round(time.perf_counter() - started)}))
            greedy = " ".join(f"{r['pass@1_greedy']:.3f}" for r in read_run(method, folder))
            elapsed = time.perf_counter() - t0
            print(f"{method} lr {lr:g} seed {seed}: greedy {greedy} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
        return read_run(method, folder)

    def available(method: str, lr: float, seed: int) -> bool:  # done, or time (and leave) to run it
        if (work / method / f"lr{lr:g}" / f"seed{seed}" / "done").exists():
            return True
        if args.report_only:
            return False
        return args.time_limit is None or not ran or time.perf_counter() - t0 <= 60 * args.time_limit

    def score(method: str, lr: float) -> float | None:  # the seed-0 run's validation score; None: no time to run it
        if not available(method, lr, 0):
            return None
        run(method, lr, 0)
        return json.loads((work / method / f"lr{lr:g}" / "seed0" / "done").read_text())["pass@1"]

    # First every method's sweep on seed 0, then the other seeds at each method's best rate: a run stopped halfway
    # already compares every method on one seed.
    sweeps = {}
    for method in args.methods:
        done = lambda lr: (work / method / f"lr{lr:g}" / "seed0" / "done").exists()  # noqa: E731
        sweeps[method] = climb(setting["lrs"], lambda lr: score(method, lr), done)
    for method, sweep in sweeps.items():
        if sweep is None:
            continue
        best = best_rate(sweep)
        seeds = [seed for seed in range(setting["seeds"]) if available(method, best, seed)]
        runs = [run(method, best, seed) for seed in seeds]
        validation = [json.loads((work / method / f"lr{best:g}" / f"seed{seed}" / "done").read_text()) for seed in seeds]
        results["methods"][method] = {"lr": best, "sweep": {f"{lr:g}": v for lr, v in sweep.items()}, "runs": runs,
                                      "validation": [{k: v[k] for k in ("pass@1", "pass@1_greedy")} for v in validation]}
    finished = all(len(results["methods"].get(m, {"runs": []})["runs"]) == setting["seeds"] for m in args.methods)

    results["title"] = (f"{setting['description']}: {setting['prompts']} prompts x {setting['num_samples']} samples "
                        f"per round, {setting['rounds']} rounds, batch {setting['batch']}")  # fmt: skip
    results["settings"] = {k: v for k, v in setting.items()
                           if isinstance(v, (int, float, str, bool, list)) and k != "model"}  # fmt: skip
    results["seconds_this_call"] = round(time.perf_counter() - t0)
    table, diagnosis = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    if results["methods"]:
        plot(results, out / "iterative.png")
    files = {"results.json": results, "table.md": f"{results['title']}\n\n{table}\n",
             "diagnosis.md": f"{results['title']}\n\n{diagnosis}\n",
             "sweep.md": f"{results['title']}\n\n{sweep_table(work, args.methods, setting['rounds'])}\n"}
    save(out, files, script=__file__, argv=argv, started=started, append=True)  # a record per call: it resumes
    status = "complete" if finished else "stopped at the time limit: run the same command again to go on"
    print(f"{results['title']}; {results['seconds_this_call']} s this call, {status}\n\n{table}\n\n{diagnosis}")
    return table


PAST_EDGE = 2  # the most rates a sweep follows its best past the grid's edge


def climb(rates: list[float], score, done) -> dict | None:
    """A learning-rate sweep: `score(rate)` of each rate in ascending order, stopping at the first rate that scores
    below a smaller one (past the peak, larger rates are not trained; those already `done` are still read). A best
    rate at an edge of the rates scored is not known to be the best: then the next rate past that edge is scored, up
    to `PAST_EDGE` rates beyond the grid. Returns {rate: score}, or None when `score` returns None (no time left to
    run that rate)."""
    scores, past_peak = {}, False
    for rate in sorted(rates):
        if past_peak and not done(rate):
            continue
        value = score(rate)
        if value is None:
            return None
        scores[rate] = value
        past_peak = past_peak or value < max(scores.values())
    for _ in range(PAST_EDGE if len(rates) > 1 else 0):
        best = best_rate(scores)
        if best not in (min(scores), max(scores)):
            break
        extra = beyond(best, up=best == max(scores))
        value = score(extra)
        if value is None:
            return None
        scores[extra] = value
    return scores


def best_rate(scores: dict) -> float:
    return max(scores, key=lambda rate: (scores[rate], -rate))  # ties: the smaller rate


def beyond(rate: float, up: bool) -> float:
    """The next rate past `rate` on the 1-3-10 ladder (..., 1e-5, 3e-5, 1e-4, ...)."""
    threes = f"{rate:.0e}".startswith("3")
    factor = (10 / 3 if threes else 3) if up else (3 if threes else 10 / 3)
    return float(f"{rate * factor if up else rate / factor:.0e}")


def validate(setting: dict, method: str, folder: Path, seed: int) -> dict:
    """Pass@1 of a run's final model on the validation split: sampled (`k` samples a prompt, the sweep's
    score: the expected reward that training maximizes, less noisy than greedy) and greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_topr import evaluate_policy

    if method == "grpo":
        final = max(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    else:
        final = folder / f"round-{setting['rounds']}"
    metrics = evaluate_policy(AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final),
                              setting["val"], setting["reward"], setting["answer"], num_samples=setting["k"],
                              progress=False, **sampling(setting, seed))  # fmt: skip
    return {key: metrics[key] for key in ("pass@1", "pass@1_greedy")}


if __name__ == "__main__":
    main()
