"""Iterative training at equal sampling budgets, the paper's regime: sample with the current model, train, repeat.
TOPR against positives-only (RFT/STaR), REINFORCE, TOPR with a target positive fraction, TOPR on Anna Karenina-curated
rounds and TRL's GRPOTrainer online on the same prompts and reward, each round on-policy; and, in the off-policy regime
TOPR is made for, TOPR (with target positive fractions 0.2, 0.5 and 0.8, or none), positives-only, REINFORCE and
truncated IS (TIS), each round replaying the samples of the rounds before it.

    python benchmarks/iterative.py --scale fast            # tiny Llama, digit reversal (CPU time: docs/benchmarks.md)
    python benchmarks/iterative.py --scale real --plan     # SmolLM2-135M-Instruct, two-digit products: the runs, hours
    python benchmarks/iterative.py --scale fast --quick    # smoke run (tests/test_benchmarks.py)

Every finished run (method, learning rate, seed) is recorded in `runs/<method>.jsonl` of --out, committed with the
results, and never trained again: run the command again, here or on another machine, to go on where it stopped
(`--time_limit` stops cleanly after that many minutes; an unfinished run resumes from its last round under --work).
Calls with different `--methods` can run side by side (each writes the results of the runs it has seen; run
`--report_only` once they are done to write those of all).

Learning rates are chosen per sampled completion: a run's criterion is the mean of its validation sampled pass@1 over
rounds 1..R (the area under its learning curve, every round sampling as many completions), averaged over the first
`sweep_seeds` seeds; the last round's validation score is kept beside it. On-policy arms climb their grid from its
smallest rate and stop at the first rate that scores below a smaller one; while the best is at an edge of the rates
scored, the next rate past it is scored too (up to `past_edge` beyond the grid). Replay arms score every rate of
their grid (`replay_lrs`: the same-rate table), then follow an edge the same way. Each arm's best rate then runs the
other seeds. The reported numbers are on a separate test split: every round at the fast scale, at `test_rounds` at
the real scale (round 0 once per seed), where evaluation would otherwise dominate a run's time.

- Loop methods (`run_topr_loop`, one epoch per round, a fresh optimizer each round): each round samples
  `num_samples` completions of every training prompt with the current model (mu = that model), scores them +1 / -1,
  trains one epoch, evaluates on the held-out splits. `+replay` arms (`replay_rounds`): each round trains on its own
  samples plus those of the `replay` rounds before it, with the behavior log-probs recorded when they were sampled, so
  every sample is trained `replay + 1` times while the policy moves away from it; they sample exactly as much.
- GRPO (TRL's `GRPOTrainer`, online): the same prompts, `num_generations = num_samples`, the same completions per
  optimizer step as the loop's batch; one pass over the prompts samples as many completions as one loop round. Each
  round is a fresh trainer started from the previous round's model, as the loop's rounds (a fresh optimizer), and is
  evaluated with the loop's generation engine. Its completions and their tokens are counted by its reward function.

The x axis is what was sampled so far (completions and completion tokens), the same for every method. Writes
`results.json`, `table.md` (test sampled pass@1 per round at each arm's rate), `efficiency.md` (completions sampled
until each seed first reaches 0.8 and 0.9), `diagnosis.md`, `ages.md` (the replay arms' metrics by sample age),
`sweep.md` (every rate scored, per seed, with its test curve) and `iterative.png` to --out (default
benchmarks/results/iterative-<scale>). `--plan` prints the runs the protocol may train and their estimated hours.
"""

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import time
from functools import partial
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
    # the off-policy regime: every round also trains on the samples of the `replay` rounds before it
    "topr+replay": {"loss_type": "topr"},
    "topr_peff0.2+replay": {"loss_type": "topr", "target_positive_fraction": 0.2},
    "topr_peff0.5+replay": {"loss_type": "topr", "target_positive_fraction": 0.5},
    "topr_peff0.8+replay": {"loss_type": "topr", "target_positive_fraction": 0.8},
    "positives_only+replay": {"loss_type": "positives_only"},
    "reinforce+replay": {"loss_type": "reinforce"},
    "tis+replay": {"loss_type": "tis"},
}
REPLAY = "+replay"
SCALES = {
    # prompts: training prompts sampled every round; val / test: held-out prompts; k: samples per held-out prompt;
    # lrs: the on-policy arms' grid; replay_lrs: the replay arms' grid, every rate of it scored (the same-rate table);
    # test_rounds: the rounds evaluated on the test split (None: every round); methods: the arms of the scale
    "fast": {"prompts": 64, "num_samples": 8, "val": 64, "test": 128, "k": 4, "rounds": 8, "seeds": 3, "batch": 16,
             "lrs": [3e-5, 1e-4, 3e-4, 1e-3], "replay_lrs": [1e-5, 1e-4, 3e-4, 1e-3], "past_edge": 2,
             "max_new_tokens": 12, "bf16": False, "replay": 3, "sweep_seeds": 2, "test_rounds": None,
             "methods": list(METHODS), "run_seconds": 60},
    # SmolLM2 on two-digit products, where it starts at a low sampled pass@1 (negatives outnumber positives)
    # (its 8-hour budget on 2 cores sets the sizes: 32 prompts, the validation split every round, the test split at
    # rounds 0, 2 and 4; bf16 where the CPU's probe finds it faster, the precision recorded with each run)
    "real": {"prompts": 32, "num_samples": 4, "val": 48, "test": 256, "k": 4, "rounds": 4, "seeds": 3, "batch": 8,
             "lrs": [3e-6, 1e-5, 3e-5], "replay_lrs": [3e-6, 1e-5, 3e-5], "past_edge": 0, "max_new_tokens": 48,
             "bf16": None, "replay": 1, "sweep_seeds": 2, "test_rounds": [0, 2, 4],
             # every replay rate on two seeds does not fit the 8 hours: the replay arms climb like the others
             "replay_every_rate": False,
             "methods": ["positives_only", "positives_only+replay", "topr_peff0.8+replay", "topr+replay",
                         "reinforce+replay", "grpo"], "run_seconds": 1200},
}  # fmt: skip
QUICK = {"prompts": 8, "num_samples": 4, "val": 4, "test": 4, "k": 1, "rounds": 2, "seeds": 2, "batch": 8,
         "lrs": [3e-4], "replay_lrs": [3e-4], "replay": 1, "sweep_seeds": 1}


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
        from common import few_shot_prompts

        from trl_topr.embedded import smollm2_path
        from trl_topr.rewards import extract_final_answer, gsm8k_reward

        problems = product_problems()  # the first is the one-shot example
        model, rows = smollm2_path(), list(few_shot_prompts(problems[1:], problems[:1]))
        task = {"reward": gsm8k_reward, "answer": extract_final_answer,
                "description": "SmolLM2-135M-Instruct, 'What is a * b?' (a 11-99, b 2-9), one-shot"}  # fmt: skip
    train, val = rows[: splits[0]], rows[splits[0] : splits[0] + splits[1]]
    test = rows[splits[0] + splits[1] : sum(splits)]
    return dict(settings, model=str(model), train=Dataset.from_list(train), val=Dataset.from_list(val),
                test=Dataset.from_list(test), **task)  # fmt: skip


def product_problems() -> list[dict[str, str]]:
    """The real scale's task, in GSM8K's question/answer format: the 712 products `a * b`, a in 11-99 and b in 2-9,
    shuffled."""
    problems = [{"question": f"What is {a} * {b}?", "answer": f"{a} * {b} = {a * b}\n#### {a * b}"}
                for a in range(11, 100) for b in range(2, 10)]  # fmt: skip
    random.Random(0).shuffle(problems)
    return problems


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
def held_out(setting: dict) -> dict:
    """The held-out splits a run evaluates after every round: validation (the rate criterion's), and test unless the
    scale evaluates it at a few rounds only (`test_rounds`, see `evaluate_test`)."""
    return {"validation": setting["val"], **({"test": setting["test"]} if setting["test_rounds"] is None else {})}


def run_loop(method: str, setting: dict, lr: float, seed: int, folder: Path, use_vllm: bool) -> None:
    """Go on with a loop method's run (the loop resumes after its last completed round)."""
    from trl_topr import TOPRConfig, anna_karenina, run_topr_loop
    from trl_topr.generation import SamplingSettings

    args = TOPRConfig(**training_args(setting, folder, lr, seed, use_vllm=use_vllm), **METHODS[method])
    run_topr_loop(
        setting["model"], setting["train"], setting["reward"], args, num_rounds=setting["rounds"],
        eval_prompts=held_out(setting), correct_func=setting["reward"], answer_func=setting["answer"],
        curate=anna_karenina if method == "topr_anna_karenina" else None,
        sampling=SamplingSettings(num_samples=setting["num_samples"], **sampling(setting)),
        eval_sampling=SamplingSettings(num_samples=setting["k"], **sampling(setting, seed)), progress=False,
        replay_rounds=setting["replay"] if method.endswith(REPLAY) else 0,
    )  # fmt: skip


def delete_old_weights(folder: Path, rounds: int) -> None:
    for old in folder.glob("round-*/model*.safetensors"):
        if old.parent.name != f"round-{rounds}":
            old.unlink()


def evaluate_test(setting: dict, folder: Path, seed: int, work: Path, use_vllm: bool) -> None:
    """Where the scale evaluates the test split at a few rounds only (`test_rounds`): evaluate the run's models of
    those rounds not yet in its `test.jsonl`, one line each. Round 0 (the starting model, the same in every run of a
    seed) is evaluated once per seed, in --work."""
    from transformers import AutoTokenizer

    from trl_topr import TOPRConfig
    from trl_topr.evaluation import evaluate_with_engine
    from trl_topr.generation import SamplingSettings, generation_engine

    path = folder / "test.jsonl"
    done = {json.loads(line)["round"] for line in path.read_text().splitlines()} if path.exists() else set()
    todo = [r for r in setting["test_rounds"] if r <= setting["rounds"] and r not in done]
    if not todo:
        return
    start = work / f"start-test-seed{seed}.json"
    tokenizer = AutoTokenizer.from_pretrained(setting["model"])
    engine, eval_sampling = None, SamplingSettings(num_samples=setting["k"], **sampling(setting, seed))
    try:
        for r in todo:
            if r == 0 and start.exists():
                metrics = json.loads(start.read_text())
            else:
                model = setting["model"] if r == 0 else str(folder / f"round-{r}")
                if engine is None:
                    args = TOPRConfig(**training_args(setting, folder / "test-engine", 0.0, seed, use_vllm=use_vllm))
                    engine = generation_engine(model, tokenizer, args)
                engine.load_weights(model)
                metrics = evaluate_with_engine(engine, tokenizer, setting["test"], setting["reward"],
                                               setting["answer"], eval_sampling, progress=False)  # fmt: skip
                engine.release_weights()
                if r == 0:
                    start.write_text(json.dumps(metrics))
            with open(path, "a") as f:
                f.write(json.dumps({"round": r, **metrics}) + "\n")
    finally:
        if engine is not None:
            engine.close()


def run_grpo(setting: dict, lr: float, seed: int, folder: Path, use_vllm: bool) -> None:
    """Go on with TRL's GRPOTrainer, one pass over the prompts (one loop round's worth of samples) a round. Each round
    is a fresh trainer (a fresh optimizer, as the loop's rounds) started from the previous round's model, saved to
    `round-<r>/` and evaluated with the generation engine the loop methods evaluate with. With `use_vllm`, GRPO
    samples with vLLM colocated (TRL's sampler with vLLM's CPU build fixed, as `TOPRGRPOTrainer` uses it)."""
    from contextlib import nullcontext
    from unittest.mock import patch

    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    from trl_topr import TOPRConfig
    from trl_topr.evaluation import evaluate_with_engine
    from trl_topr.generation import SamplingSettings, generation_engine
    from trl_topr.generation.vllm_engine import TOPRVLLMGeneration

    steps_per_round = setting["prompts"] * setting["num_samples"] // setting["batch"]
    metrics_file = folder / "metrics.jsonl"
    evaluated = len(metrics_file.read_text().splitlines()) if metrics_file.exists() else 0  # rounds 0, 1, ...
    tokenizer = AutoTokenizer.from_pretrained(setting["model"])
    engine_args = TOPRConfig(**training_args(setting, folder, lr, seed, use_vllm=use_vllm))
    engine = generation_engine(setting["model"], tokenizer, engine_args)
    eval_sampling = SamplingSettings(num_samples=setting["k"], **sampling(setting, seed))
    counted = {}  # what GRPO sampled this round, as its reward function saw it

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        counted["num_samples"] = counted.get("num_samples", 0) + len(completions)
        counted["num_tokens"] = counted.get("num_tokens", 0) + sum(len(ids) for ids in completion_ids)
        return setting["reward"](prompts, completions, completion_ids=completion_ids, **kwargs)

    reward.__name__ = setting["reward"].__name__

    def evaluate(model_folder: str, round_index: int, extra: dict, model=None) -> None:
        engine.load_weights(model_folder, model=model)
        metrics = dict(extra)
        for name, prompts in held_out(setting).items():
            values = evaluate_with_engine(engine, tokenizer, prompts, setting["reward"], setting["answer"],
                                          eval_sampling, progress=False)  # fmt: skip
            metrics.update({f"{name}/{key}": value for key, value in values.items()})
        with open(metrics_file, "a") as f:
            f.write(json.dumps({"round": round_index, **metrics}) + "\n")

    vllm_args = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 1024} if use_vllm else {}
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if not evaluated:  # round 0: the starting model
            evaluate(setting["model"], 0, {})
            evaluated = 1
        for round_index in range(evaluated, setting["rounds"] + 1):
            previous = setting["model"] if round_index == 1 else str(folder / f"round-{round_index - 1}")
            args = GRPOConfig(**training_args(
                setting, folder / f"round-{round_index}", lr, seed + round_index, max_steps=steps_per_round,
                num_generations=setting["num_samples"], max_completion_length=setting["max_new_tokens"],
                temperature=1.0, top_k=0, beta=0.0, **vllm_args,
            ))  # fmt: skip
            with patch.object(grpo_trainer, "VLLMGeneration", TOPRVLLMGeneration) if use_vllm else nullcontext():
                trainer = GRPOTrainer(previous, reward_funcs=reward, args=args, train_dataset=setting["train"])
            trainer.remove_callback(PrinterCallback)
            counted.clear()
            trainer.train()
            trainer.save_model(args.output_dir)
            logs = [h for h in trainer.state.log_history if "reward" in h]
            extra = {"reward": statistics.fmean(h["reward"] for h in logs), **counted}
            evaluate(args.output_dir, round_index, extra, model=trainer.model)
            engine.release_weights()
            del trainer
            gc.collect()  # its colocated vLLM engine goes with it
    finally:
        engine.close()


def read_run(method: str, folder: Path) -> list[dict]:
    """A run's rounds: held-out metrics (`validation/...` every round, `test/...` at the test rounds), what was sampled
    so far, and (loop methods) the trainer's per-round means."""
    metrics_file = folder / "metrics.jsonl"
    rounds = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    tests = folder / "test.jsonl"
    for line in tests.read_text().splitlines() if tests.exists() else []:
        test = json.loads(line)
        rounds[test.pop("round")].update({f"test/{key}": value for key, value in test.items()})
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


def validation_scores(rounds: list[dict]) -> dict:
    """The rate criterion of a run: the mean of its validation sampled pass@1 over rounds 1..R (`mean`, the area
    under its learning curve against completions sampled, every round sampling as many), and after the last round
    (`last`, what a user has after spending every sample)."""
    curve = [r["validation/pass@1"] for r in rounds[1:]]
    return {"mean": statistics.fmean(curve), "last": curve[-1], "greedy_last": rounds[-1]["validation/pass@1_greedy"]}


# -------------------------------------------------------------------------------------------------------------- report
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
    header = ["method", "lr", "seeds", "validation mean", *[f"r{r}" for r in sampled], "greedy", "invalid",
              "completions"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    diagnosis_header = ["method", "round", "positive fraction", "effective positive fraction", "negative weight share",
                        "negative weight mean", "tapered negatives", "log ratio mean", "log ratio min"]  # fmt: skip
    diagnosis = ["| " + " | ".join(diagnosis_header) + " |", "|" + "---|" * len(diagnosis_header)]
    for method, entry in results["methods"].items():
        runs = complete(entry, rounds)
        if not runs:
            continue
        criterion = mean_std([v["mean"] for v in entry["validation"] if "mean" in v])
        cells = [method, f"{entry['lr']:g}", str(len(runs)), criterion,
                 *[mean_std([at(run[r], "pass@1") for run in runs]) for r in sampled],
                 mean_std([at(run[-1], "pass@1_greedy") for run in runs]),
                 mean_std([at(run[-1], "invalid_rate") for run in runs]), str(runs[0][-1]["sampled_completions"])]
        table.append("| " + " | ".join(cells) + " |")
        if method == "grpo":
            continue
        for r in range(1, rounds + 1):
            cell = lambda key: mean_std([run[r].get(key, float("nan")) for run in runs])  # noqa: E731
            diagnosis.append("| " + " | ".join([
                method, str(r), cell("positive_fraction"), cell("effective_positive_fraction"),
                cell("train/negative_weight_share"), cell("train/negative_weight_mean"),
                cell("train/negative_tapered_fraction"), cell("train/log_ratio_mean"), cell("train/log_ratio_min"),
            ]) + " |")  # fmt: skip
    per_round = results["settings"]["prompts"] * results["settings"]["num_samples"]
    note = (f"\n\nTest split, sampled pass@1 after round r (r0 = the starting model; each round samples {per_round} "
            "completions), mean ± standard deviation over seeds; greedy and invalid: after the last round. lr: the "
            "rate of the sweep with the highest validation mean (sampled pass@1 on the validation split averaged "
            "over rounds 1..R, mean over the sweep seeds).")  # fmt: skip
    return "\n".join(table) + note, "\n".join(diagnosis)


def efficiency_table(results: dict, thresholds=(0.8, 0.9)) -> str:
    """Markdown: for every arm at its chosen rate, the completions sampled until each seed's test sampled pass@1 first
    reaches each threshold ("-": never within the run), seed by seed."""
    rounds = results["settings"]["rounds"]
    header = ["method", "lr", *[f"to {t:g} (by seed)" for t in thresholds]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, entry in results["methods"].items():
        runs = complete(entry, rounds)
        if runs:
            cells = [" / ".join(str(first_reaching(run, t) or "-") for run in runs) for t in thresholds]
            lines.append("| " + " | ".join([method, f"{entry['lr']:g}", *cells]) + " |")
    return "\n".join(lines) + "\n\nCompletions sampled when the test sampled pass@1 first reached the threshold."


def first_reaching(run: list[dict], threshold: float) -> int | None:
    """Completions sampled by the first round whose test sampled pass@1 is at least `threshold`, or None."""
    return next((r["sampled_completions"] for r in run if at(r, "pass@1") >= threshold), None)


def sweep_table(ledger: "Ledger", setting: dict) -> str:
    """Markdown: every rate scored by a sweep (the sweep seeds' runs): the validation criterion that picks the rate
    (the mean over rounds 1..R) and each seed's, the validation score after the last round, and the test sampled
    pass@1 per round (mean ± standard deviation over the seeds). For the replay arms, every rate of their grid: the
    same-rate table."""
    rounds = [r for r in range(setting["rounds"] + 1) if setting["test_rounds"] is None or r in setting["test_rounds"]]
    header = ["method", "lr", "seeds", "validation mean", "by seed", "validation last",
              *[f"test r{r}" for r in rounds]]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in METHODS:
        for lr in ledger.rates(method):
            entries = [e for seed in range(setting["sweep_seeds"]) if (e := ledger.get(method, lr, seed)) is not None]
            if not entries:
                continue
            means = [e["validation"]["mean"] for e in entries]
            cells = [method, f"{lr:g}", str(len(entries)), mean_std(means), " / ".join(f"{v:.3f}" for v in means),
                     mean_std([e["validation"]["last"] for e in entries]),
                     *[mean_std([at(e["rounds"][r], "pass@1") for e in entries]) for r in rounds]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nSeeds 0-{setting['sweep_seeds'] - 1}; validation mean: sampled pass@1 on the "
                               "validation split averaged over rounds 1..R; last: after round R; test: sampled pass@1 "
                               "on the test split after round r.")  # fmt: skip


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

    panels = [("pass@1", "test sampled pass@1"), ("pass@1_greedy", "test greedy pass@1"),
              ("invalid_rate", "test invalid rate (samples)")]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for method, entry in results["methods"].items():
        runs = complete(entry, results["settings"]["rounds"])
        if not runs:
            continue
        style = {"linewidth": 2.5, "color": "black"} if method.startswith("topr") and "_" not in method else {
            "linewidth": 1.2}
        style["linestyle"] = "--" if method.endswith(REPLAY) else "-"
        for ax, (key, title) in zip(axes, panels):
            points = [(run_round["sampled_completions"], [at(run[i], key) for run in runs])
                      for i, run_round in enumerate(runs[0]) if at(run_round, key) == at(run_round, key)]  # fmt: skip
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


# ---------------------------------------------------------------------------------------------------------------- main
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
                    print(f"{path}: the last line is cut short (a call stopped while writing it): its run will be "
                          "trained again", file=sys.stderr)  # fmt: skip
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


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SCALES), default="fast")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS),
                        help="the arms to train (default: the scale's; the report covers every arm of the results)")
    parser.add_argument("--work", help="unfinished runs, resumable (default: outputs/iterative-<scale>[-quick])")
    parser.add_argument("--out", help="results (default: benchmarks/results/iterative-<scale>, "
                                      "outputs/iterative-<scale>-results-quick with --quick)")
    parser.add_argument("--time_limit", type=float, help="minutes: stop after the run that crosses it")
    parser.add_argument("--report_only", action="store_true", help="write the finished runs' results, train nothing")
    parser.add_argument("--plan", action="store_true",
                        help="print the runs the protocol may train and their estimated hours, train nothing")
    parser.add_argument("--use_vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="sample and evaluate with vLLM (default: at the real scale, where vLLM is installed)")
    args = parser.parse_args(argv)
    suffix = f"{args.scale}{'-quick' if args.quick else ''}"
    work = Path(args.work or ROOT / "outputs" / f"iterative-{suffix}")
    out = Path(args.out or ROOT / (f"outputs/iterative-{args.scale}-results-quick" if args.quick
                                   else f"benchmarks/results/iterative-{args.scale}"))  # fmt: skip
    started = time.time()
    if args.use_vllm is None:
        import importlib.util

        args.use_vllm = args.scale == "real" and importlib.util.find_spec("vllm") is not None
    ledger = Ledger(out)
    setting = dict(SCALES[args.scale], **(QUICK if args.quick else {}))
    methods = [m for m in METHODS if m in (args.methods or setting["methods"])]
    if args.plan:
        text = plan(setting, methods, ledger)
        print(text)
        return text
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    setting = setup(args.scale, work, args.quick)
    ran = []  # the runs this call trained (the time limit stops after at least one)

    def run(method: str, lr: float, seed: int) -> dict:
        if (entry := ledger.get(method, lr, seed)) is None:
            folder = work / method / f"lr{lr:g}" / f"seed{seed}"
            resumed = (folder / "metrics.jsonl").exists()  # begun by an earlier call: `seconds` is this call's part
            started = time.perf_counter()
            if method == "grpo":
                run_grpo(setting, lr, seed, folder, args.use_vllm)
            else:
                run_loop(method, setting, lr, seed, folder, args.use_vllm)
            if setting["test_rounds"] is not None:
                evaluate_test(setting, folder, seed, work, args.use_vllm)
            delete_old_weights(folder, setting["rounds"])
            ran.append(folder)
            rounds = read_run(method, folder)
            entry = {"method": method, "lr": lr, "seed": seed, "validation": validation_scores(rounds),
                     "seconds": round(time.perf_counter() - started), "resumed": resumed, "rounds": rounds,
                     "bf16": training_args(setting, folder, lr, seed)["bf16"]}  # fmt: skip
            ledger.add(entry)
            curve = " ".join(f"{r['validation/pass@1']:.3f}" for r in rounds)
            elapsed = time.perf_counter() - t0
            print(f"{method} lr {lr:g} seed {seed}: validation sampled {curve} ({elapsed:.0f} s)", file=sys.stderr,
                  flush=True)  # fmt: skip
        return entry

    def available(method: str, lr: float, seed: int) -> bool:  # finished, or to train now (time left, not report only)
        if ledger.get(method, lr, seed) is not None:
            return True
        if args.report_only or method not in methods:
            return False
        return args.time_limit is None or not ran or time.perf_counter() - t0 <= 60 * args.time_limit

    def score(method: str, lr: float) -> float | None:  # the sweep seeds' mean validation criterion; None: not run
        values = []
        for seed in range(setting["sweep_seeds"]):  # the time limit is checked before each run
            if not available(method, lr, seed):
                return None
            values.append(run(method, lr, seed)["validation"]["mean"])
        return statistics.fmean(values)

    # First every arm's sweep, then the other seeds at each arm's best rate: a call stopped halfway already compares
    # the arms swept. Replay arms score every rate of their grid (the same-rate table).
    results = {"methods": {}}
    sweeps = {method: sweep(setting, method, partial(score, method), ledger) for method in METHODS
              if method in methods or ledger.rates(method)}
    for method, scores in sweeps.items():
        if scores is None:
            continue
        best = best_rate(scores)
        entries = [run(method, best, seed) for seed in range(setting["seeds"]) if available(method, best, seed)]
        results["methods"][method] = {
            "lr": best, "sweep": {f"{lr:g}": v for lr, v in scores.items()}, "runs": [e["rounds"] for e in entries],
            "validation": [e["validation"] for e in entries], "seconds": [e["seconds"] for e in entries],
            "replay_rounds": setting["replay"] if method.endswith(REPLAY) else 0,
        }  # fmt: skip
    unfinished = [m for m in methods if len(results["methods"].get(m, {"runs": []})["runs"]) < setting["seeds"]]

    results["title"] = (f"{setting['description']}: {setting['prompts']} prompts x {setting['num_samples']} samples "
                        f"per round, {setting['rounds']} rounds, batch {setting['batch']}")  # fmt: skip
    results["settings"] = {k: v for k, v in setting.items()
                           if isinstance(v, (int, float, str, bool, list, type(None))) and k != "model"}  # fmt: skip
    results["seconds_this_call"] = round(time.perf_counter() - t0)
    table, diagnosis = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    if results["methods"]:
        plot(results, out / "iterative.png")
    files = {"results.json": results, "table.md": f"{results['title']}\n\n{table}\n",
             "efficiency.md": f"{results['title']}\n\n{efficiency_table(results)}\n",
             "diagnosis.md": f"{results['title']}\n\n{diagnosis}\n",
             "ages.md": f"{results['title']}\n\n{ages_table(results)}\n",
             "sweep.md": f"{results['title']}\n\n{sweep_table(ledger, setting)}\n"}
    save(out, files, script=__file__, argv=argv, started=started, append=True)  # a record per call: it resumes
    status = "complete" if not unfinished else (
        f"not finished: {', '.join(unfinished)}. Run the same command again to go on")
    print(f"{results['title']}; {results['seconds_this_call']} s this call, {status}\n\n{table}\n\n{diagnosis}")
    return table


def grid(setting: dict, method: str) -> list[float]:
    return setting["replay_lrs"] if method.endswith(REPLAY) else setting["lrs"]


def sweep(setting: dict, method: str, score, ledger: "Ledger") -> dict | None:
    """An arm's rate sweep (see `climb`): the replay arms score every rate of their grid (the same-rate table) where
    the scale's `replay_every_rate` is true, the default; the others stop past the peak (rates already in the ledger
    are still read)."""
    every = method.endswith(REPLAY) and setting.get("replay_every_rate", True)
    return climb(grid(setting, method), score, lambda lr: every or all(
        ledger.get(method, lr, seed) is not None for seed in range(setting["sweep_seeds"])),
        past_edge=setting.get("past_edge", PAST_EDGE))  # fmt: skip


def plan(setting: dict, methods: list[str], ledger: "Ledger") -> str:
    """The runs the protocol may train, arm by arm (every grid rate on the sweep seeds, then the other seeds at the
    best rate, and the rates past an edge where the scale follows them), with those already in the ledger, and the
    estimated hours of the rest: each run at the mean seconds of the arm's finished runs, else of all finished runs,
    else the scale's `run_seconds` estimate."""
    finished = [e["seconds"] for e in ledger.runs.values() if not e["resumed"]]
    default = statistics.fmean(finished) if finished else setting["run_seconds"]
    lines, total_todo, total_runs = [], 0.0, 0
    for method in methods:
        rates = grid(setting, method)
        seeds = setting["sweep_seeds"] * (len(rates) + setting.get("past_edge", PAST_EDGE))
        most = seeds + setting["seeds"] - setting["sweep_seeds"]  # the sweep, then the other seeds at the best rate
        done = sum(m == method for m, _, _ in ledger.runs)
        own = [e["seconds"] for (m, _, _), e in ledger.runs.items() if m == method and not e["resumed"]]
        each = statistics.fmean(own) if own else default
        todo = max(most - done, 0) * each / 3600
        total_todo, total_runs = total_todo + todo, total_runs + most
        lines.append(f"{method}: rates {' '.join(f'{r:g}' for r in rates)} on seeds 0-{setting['sweep_seeds'] - 1}, "
                     f"then seeds up to {setting['seeds'] - 1} at the best: at most {most} runs, {done} done, "
                     f"{each / 60:.0f} min a run, at most {todo:.1f} h to go")  # fmt: skip
    lines.append(f"In all: at most {total_runs} runs, at most {total_todo:.1f} h to go on one process "
                 f"(two processes with one thread each, --methods split between them: about half the wall time)")
    return "\n".join(lines)


PAST_EDGE = 2  # the most rates a sweep follows its best past the grid's edge


def climb(rates: list[float], score, done, past_edge: int = PAST_EDGE) -> dict | None:
    """A learning-rate sweep: `score(rate)` of each rate in ascending order, stopping at the first rate that scores
    below a smaller one (past the peak, larger rates are not trained; those already `done` are still read). A best
    rate at an edge of the rates scored is not known to be the best: then the next rate past that edge is scored, up
    to `past_edge` rates beyond the grid. Returns {rate: score}, or None when `score` returns None (no time left to
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
    for _ in range(past_edge if len(rates) > 1 else 0):
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


if __name__ == "__main__":
    main()
