"""Iterative training at equal sampling budgets, the paper's regime: sample with the current model, train, repeat.
TOPR against positives-only (RFT/STaR), REINFORCE, TOPR with a target positive fraction, TOPR on Anna Karenina-curated
rounds and TRL's GRPOTrainer online on the same prompts and reward, each round on-policy; and, in the off-policy regime
TOPR is made for, TOPR (with target positive fractions 0.2, 0.5 and 0.8, or none), positives-only, REINFORCE and
truncated IS (TIS), each round replaying the samples of the rounds before it.

    python benchmarks/iterative.py --scale fast            # tiny Llama, digit reversal (its CPU time: docs/)
    python benchmarks/iterative.py --scale real --plan     # SmolLM2-135M-Instruct, two-digit products: the runs, hours
    python benchmarks/iterative.py --scale fast --quick    # smoke run (tests/test_benchmarks.py)
    python benchmarks/iterative.py --scale fast --seeds 8 --out benchmarks/results/iterative-fast-8
                                                           # 8 seeds, from a copy of the fast scale's ledger

Every finished run (method, learning rate, seed) is recorded in `runs/<method>.jsonl` of --out, committed with the
results, and never trained again: run the command again, here or on another machine, to go on where it stopped
(`--time_limit` stops cleanly after that many minutes; an unfinished run resumes from its last round under --work).
Calls with different `--methods` can run side by side (each writes the results of the runs it has seen; run
`--report_only` once they are done to write those of all); calls of the same arms split its seeds with `--skip_seeds`.

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
benchmarks/results/iterative-<scale>). `--plan` prints the runs the protocol may train and their estimated hours (of
the seeds this call trains: those of `--skip_seeds` are another call's).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
from arms import ARMS
from iterative_report import ages_table, efficiency_table, plot, summarize, sweep_table
from ledger import Ledger, per_prompt_lists, read_run, validation_scores
from provenance import save
from search import best_rate, plan, reference, sweep
from tasks import (
    PRETRAIN_ROWS,
    pretrain_reverser,
    product_problems,
    reversal_answer,
    reversal_numbers,
    reversal_reward,
    reversal_rows,
)


SCALES = {
    # prompts: training prompts sampled every round; val / test: held-out prompts; k: samples per held-out prompt;
    # lrs: the on-policy arms' grid; replay_lrs: the replay arms' grid, every rate of it scored (the same-rate table);
    # test_rounds: the rounds evaluated on the test split (None: every round); methods: the arms of the scale;
    # thresholds, or gains over the start: the test sampled pass@1 whose completions-to-reach `efficiency.md` counts
    "fast": {
        "prompts": 64,
        "num_samples": 8,
        "val": 64,
        "test": 128,
        "k": 4,
        "rounds": 8,
        "seeds": 3,
        "batch": 16,
        "lrs": [3e-5, 1e-4, 3e-4, 1e-3],
        "replay_lrs": [1e-5, 1e-4, 3e-4, 1e-3],
        "past_edge": 2,
        "max_new_tokens": 12,
        "bf16": False,
        "replay": 3,
        "sweep_seeds": 2,
        "test_rounds": None,
        "methods": list(ARMS),
        # every seed at these rates too, whichever rate the sweep picks: positives-only and TOPR with target 0.8 at
        # the same rates, on- and off-policy, seed by seed
        "all_seeds_at": {
            method: [3e-4, 1e-3]
            for method in ("positives_only", "positives_only+replay", "topr_peff0.8", "topr_peff0.8+replay")
        },
        "run_seconds": 60,
        "thresholds": [0.8, 0.9],
    },
    # SmolLM2 on two-digit products, where it starts at a low sampled pass@1 (negatives outnumber positives)
    # (its 8-hour budget on 2 cores sets the sizes: 32 prompts, the validation split every round, the test split at
    # rounds 0, 2 and 4; bf16 where the CPU's probe finds it faster, the precision recorded with each run)
    "real": {
        "prompts": 32,
        "num_samples": 4,
        "val": 48,
        "test": 256,
        "k": 4,
        "rounds": 4,
        "seeds": 3,
        "batch": 8,
        "lrs": [3e-6, 1e-5, 3e-5],
        "replay_lrs": [3e-6, 1e-5, 3e-5],
        "past_edge": 0,
        "max_new_tokens": 48,
        "bf16": None,
        "replay": 1,
        # every replay rate on two seeds does not fit the 8 hours: the replay arms climb like the others
        "replay_every_rate": False,
        "sweep_seeds": 2,
        "test_rounds": [0, 2, 4],
        "methods": [
            "positives_only",
            "positives_only+replay",
            "topr_peff0.8+replay",
            "topr+replay",
            "reinforce+replay",
            "grpo",
        ],
        "run_seconds": 1200,
        "gains": [0.05, 0.1],
    },
    # v2 of the real scale, built to separate the methods: fresh training prompts every round (a pool of rounds x
    # prompts, disjoint from validation and test, so that no training prompt comes back within a run), 6 rounds, the
    # test split at round 0 and 3 later rounds, each swept arm's rate bracketed from v1's best (3e-6, down first) until
    # it is interior, and two reference arms at topr_peff0.8+replay's rate. float32 on every machine, so that runs
    # made on CPUs with and without fast bf16 train alike; with vLLM, mu is vLLM's float32 log-probs of the samples.
    "real-v2": {
        "prompts": 64,
        "fresh_prompts": True,
        "num_samples": 4,
        "val": 48,
        "test": 256,
        "k": 4,
        "rounds": 6,
        "seeds": 3,
        "batch": 8,
        "start_lr": 3e-6,
        "lrs": [],
        "replay_lrs": [],
        "past_edge": 0,
        "max_new_tokens": 48,
        "bf16": False,
        "sampler_logps": True,
        "replay": 1,
        "sweep_seeds": 2,
        "test_rounds": [0, 2, 4, 6],
        "methods": [
            "positives_only",
            "positives_only+replay",
            "topr_peff0.8",
            "topr_peff0.8+replay",
            "grpo",
            "topr+replay",
            "reinforce+replay",
        ],
        "references": {"topr+replay": "topr_peff0.8+replay", "reinforce+replay": "topr_peff0.8+replay"},
        "run_seconds": 2400,
        "gains": [0.05, 0.1],
    },
}
QUICK = {
    "prompts": 8,
    "num_samples": 4,
    "val": 4,
    "test": 4,
    "k": 1,
    "rounds": 2,
    "seeds": 2,
    "batch": 8,
    "lrs": [3e-4],
    "replay_lrs": [3e-4],
    "replay": 1,
    "sweep_seeds": 1,
    "all_seeds_at": {"positives_only": [1e-3]},
}


# ---------------------------------------------------------------------------------------------------------------- task
def split_sizes(settings: dict) -> tuple[int, int, int]:
    """The sizes of a scale's training pool (each round's prompts where they are fresh), validation and test splits."""
    pool = settings["prompts"] * (settings["rounds"] if settings.get("fresh_prompts") else 1)
    return pool, settings["val"], settings["test"]


def split_rows(rows: list, sizes: tuple[int, int, int]) -> tuple[list, list, list]:
    """The training, validation and test rows, in that order from the start of `rows`."""
    train, val = rows[: sizes[0]], rows[sizes[0] : sizes[0] + sizes[1]]
    return train, val, rows[sizes[0] + sizes[1] : sum(sizes)]


def setup(scale: str, work: Path, quick: bool) -> dict:
    """The starting model, the prompts (train / validation / test) and the task's functions."""
    from datasets import Dataset

    settings = dict(SCALES[scale], **(QUICK if quick else {}))
    splits = split_sizes(settings)
    if scale == "fast":
        numbers = reversal_numbers(sum(splits))
        model = work / "start"
        if not (model / "config.json").exists():  # the behavior policy of round 1, built once
            pretrain_reverser(str(model), numbers[:PRETRAIN_ROWS])
        rows = reversal_rows(numbers[PRETRAIN_ROWS:])
        task = {"reward": reversal_reward, "answer": reversal_answer, "description": "tiny Llama, reverse 4 digits"}
    else:
        from trl_topr import extract_final_answer, gsm8k_reward
        from trl_topr.embedded import smollm2_path
        from trl_topr.tasks import few_shot_prompts

        problems = product_problems()  # the first is the one-shot example
        model, rows = smollm2_path(), list(few_shot_prompts(problems[1:], problems[:1]))
        if sum(splits) > len(rows):
            raise ValueError(f"The {scale} scale needs {sum(splits)} distinct problems; the task has {len(rows)}.")
        task = {
            "reward": gsm8k_reward,
            "answer": extract_final_answer,
            "description": "SmolLM2-135M-Instruct, 'What is a * b?' (a 11-99, b 2-9), one-shot",
        }
    train, val, test = split_rows(rows, splits)
    return dict(
        settings,
        model=str(model),
        train=Dataset.from_list(train),
        val=Dataset.from_list(val),
        test=Dataset.from_list(test),
        **task,
    )


def training_args(setting: dict, out: Path, lr: float, seed: int, **overrides) -> dict:
    from trl_topr.compat import CHECKPOINTING  # the name of the transformers installed (vLLM's pins an older one)
    from trl_topr.precision import resolve_bf16  # internal: the library's precision rule, for every arm

    return {
        "output_dir": str(out),
        "use_cpu": True,
        "bf16": resolve_bf16(setting["bf16"], use_cpu=True),
        "report_to": "none",
        "seed": seed,
        "learning_rate": lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "per_device_train_batch_size": setting["batch"],
        "logging_steps": 1,
        "save_strategy": "no",
        CHECKPOINTING: False,
        "disable_tqdm": True,
        **overrides,
    }


def loop_config(setting: dict, use_vllm: bool, method: str | None = None):
    """The loop's configuration of a run of `method` (its rounds, replay and curation; without a method, what an
    evaluation needs): temperature 1 and top-k off, so that mu is the model itself; with vLLM, mu is vLLM's own
    log-probs where the scale asks for them (no second forward over every sample, as GRPO does)."""
    from trl_topr import TOPRLoopConfig

    arm = ARMS[method] if method else None
    return TOPRLoopConfig(
        num_rounds=setting["rounds"],
        replay_rounds=setting["replay"] if arm and arm.replay else 0,
        prompts_per_round=setting["prompts"] if setting.get("fresh_prompts") else None,
        curation=arm.curate if arm else None,
        num_generations=setting["num_samples"],
        num_generations_eval=setting["k"],
        temperature=1.0,
        top_k=0,
        max_completion_length=setting["max_new_tokens"],
        sampling_batch_size=32,
        use_vllm=use_vllm,
        behavior_logps_source="sampler" if use_vllm and setting.get("sampler_logps") else "trainer",
    )


# ------------------------------------------------------------------------------------------------------------ the runs
def held_out(setting: dict) -> dict:
    """The held-out splits a run evaluates after every round: validation (the rate criterion's), and test unless the
    scale evaluates it at a few rounds only (`test_rounds`, see `evaluate_test`)."""
    return {"validation": setting["val"], **({"test": setting["test"]} if setting["test_rounds"] is None else {})}


def run_loop(method: str, setting: dict, lr: float, seed: int, folder: Path, use_vllm: bool) -> None:
    """Go on with a loop method's run (the loop resumes after its last completed round)."""
    from trl_topr import TOPRConfig, run_topr_loop

    run_topr_loop(
        setting["model"],
        setting["train"],
        setting["reward"],
        loop_config(setting, use_vllm, method),
        TOPRConfig(**training_args(setting, folder, lr, seed), **ARMS[method].options),
        eval_prompts=held_out(setting),
        correct_func=setting["reward"],
        answer_func=setting["answer"],
    )


def delete_old_weights(folder: Path, rounds: int) -> None:
    for old in folder.glob("round-*/model*.safetensors"):
        if old.parent.name != f"round-{rounds}":
            old.unlink()


def evaluate_test(setting: dict, folder: Path, seed: int, work: Path, use_vllm: bool) -> None:
    """Where the scale evaluates the test split at a few rounds only (`test_rounds`): evaluate the run's models of
    those rounds not yet in its `test.jsonl`, one line each, with the number of samples each prompt had (`samples`:
    `k`, or `last_test_samples` at the last round, for pass@k with k up to it). Round 0 (the starting model, the same
    in every run of a seed) is evaluated once per seed, in --work."""
    from transformers import AutoTokenizer

    from trl_topr import TOPRConfig, evaluate_policy
    from trl_topr.generation import generation_engine

    path = folder / "test.jsonl"
    done = {json.loads(line)["round"] for line in path.read_text().splitlines()} if path.exists() else set()
    todo = [r for r in setting["test_rounds"] if r <= setting["rounds"] and r not in done]
    if not todo:
        return
    start = work / f"start-test-seed{seed}.json"
    tokenizer = AutoTokenizer.from_pretrained(setting["model"])
    loop_args = loop_config(setting, use_vllm)
    engine, eval_sampling = None, loop_args.eval_sampling(seed)
    try:
        for r in todo:
            sampling = eval_sampling
            if r == setting["rounds"] and setting.get("last_test_samples"):
                sampling = eval_sampling.replace(num_samples=setting["last_test_samples"])
            if r == 0 and start.exists():
                metrics = json.loads(start.read_text())
            else:
                model = setting["model"] if r == 0 else str(folder / f"round-{r}")
                if engine is None:
                    args = TOPRConfig(**training_args(setting, folder / "test-engine", 0.0, seed))
                    engine = generation_engine(model, tokenizer, loop_args, args)
                engine.load_weights(model)
                metrics, per_prompt = evaluate_policy(
                    None,
                    tokenizer,
                    setting["test"],
                    setting["reward"],
                    setting["answer"],
                    sampling,
                    engine=engine,
                    progress=False,
                    return_per_prompt=True,
                )
                metrics.update(per_prompt_lists(per_prompt))
                engine.release_weights()
                if r == 0:
                    start.write_text(json.dumps(metrics))
            with open(path, "a") as f:
                f.write(json.dumps({"round": r, **metrics, "samples": sampling.num_samples}) + "\n")
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

    from trl_topr import TOPRConfig, evaluate_policy
    from trl_topr.generation import generation_engine
    from trl_topr.generation.vllm_engine import TOPRVLLMGeneration  # internal: vLLM's sampler as online TOPR has it
    from trl_topr.loop import EVALUATION_FILE, round_prompts  # internal: the loop's files and prompt order, matched

    steps_per_round = setting["prompts"] * setting["num_samples"] // setting["batch"]
    metrics_file = folder / "metrics.jsonl"
    evaluated = len(metrics_file.read_text().splitlines()) if metrics_file.exists() else 0  # rounds 0, 1, ...
    tokenizer = AutoTokenizer.from_pretrained(setting["model"])
    loop_args = loop_config(setting, use_vllm)
    engine = generation_engine(
        setting["model"], tokenizer, loop_args, TOPRConfig(**training_args(setting, folder, lr, seed))
    )
    eval_sampling = loop_args.eval_sampling(seed)
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
            values, per_prompt = evaluate_policy(
                None,
                tokenizer,
                prompts,
                setting["reward"],
                setting["answer"],
                eval_sampling,
                engine=engine,
                progress=False,
                return_per_prompt=True,
            )
            (folder / f"round-{round_index}").mkdir(parents=True, exist_ok=True)  # as the loop writes them
            with open(folder / f"round-{round_index}" / f"{EVALUATION_FILE}-{name}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in per_prompt)
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
            args = GRPOConfig(
                **training_args(
                    setting,
                    folder / f"round-{round_index}",
                    lr,
                    seed + round_index,
                    max_steps=steps_per_round,
                    num_generations=setting["num_samples"],
                    max_completion_length=setting["max_new_tokens"],
                    temperature=1.0,
                    top_k=0,
                    beta=0.0,
                    **vllm_args,
                )
            )
            prompts = round_prompts(setting["train"], round_index, loop_args.prompts_per_round)  # the loop's
            with patch.object(grpo_trainer, "VLLMGeneration", TOPRVLLMGeneration) if use_vllm else nullcontext():
                trainer = GRPOTrainer(previous, reward_funcs=reward, args=args, train_dataset=prompts)
            trainer.remove_callback(PrinterCallback)
            counted.clear()
            trainer.train()
            trainer.save_model(args.output_dir)
            logs = [h for h in trainer.state.log_history if "reward" in h]
            extra = {"reward": statistics.fmean(h["reward"] for h in logs), **counted}
            evaluate(args.output_dir, round_index, extra, model=trainer.model)
            engine.release_weights()
            if use_vllm:  # its colocated engine, shut down with the layers it reloaded (a deleted trainer kept them)
                trainer.vllm_generation.close()
            del trainer
            gc.collect()
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------------------- main
class Runs:
    """The runs of one call: each trained unless the ledger has it, while time is left (`time_limit`), and recorded
    in the ledger as it finishes."""

    def __init__(self, setting: dict, ledger: Ledger, work: Path, methods: list[str], args):
        self.setting, self.ledger, self.work, self.methods, self.args = setting, ledger, work, methods, args
        self.started, self.trained = time.perf_counter(), []  # the time limit stops after at least one run

    def run(self, method: str, lr: float, seed: int) -> dict:
        """The ledger's entry of a run, trained first where the ledger has none."""
        if (entry := self.ledger.get(method, lr, seed)) is not None:
            return entry
        setting, use_vllm = self.setting, self.args.use_vllm
        folder = self.work / method / f"lr{lr:g}" / f"seed{seed}"
        resumed = (folder / "metrics.jsonl").exists()  # begun by an earlier call: `seconds` is this call's part
        started = time.perf_counter()
        (run_grpo if ARMS[method].online else partial(run_loop, method))(setting, lr, seed, folder, use_vllm)
        if setting["test_rounds"] is not None:
            evaluate_test(setting, folder, seed, self.work, use_vllm)
        delete_old_weights(folder, setting["rounds"])
        self.trained.append(folder)
        rounds = read_run(method, folder)
        entry = {
            "method": method,
            "lr": lr,
            "seed": seed,
            "validation": validation_scores(rounds),
            "seconds": round(time.perf_counter() - started),
            "resumed": resumed,
            "rounds": rounds,
            "bf16": training_args(setting, folder, lr, seed)["bf16"],
        }
        self.ledger.add(entry)
        curve = " ".join(f"{r['validation/pass@1']:.3f}" for r in rounds)
        print(
            f"{method} lr {lr:g} seed {seed}: validation sampled {curve} ({time.perf_counter() - self.started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        return entry

    def available(self, method: str, lr: float, seed: int) -> bool:
        """Finished, or to train now (an arm of this call, time left, not `--report_only`)."""
        if self.ledger.get(method, lr, seed) is not None:
            return True
        if self.args.report_only or method not in self.methods or seed in self.args.skip_seeds:
            return False
        limit = self.args.time_limit
        return limit is None or not self.trained or time.perf_counter() - self.started <= 60 * limit

    def score(self, method: str, lr: float) -> float | None:
        """The sweep seeds' mean validation criterion of a rate; None where a run is not available."""
        values = []
        for seed in range(self.setting["sweep_seeds"]):  # the time limit is checked before each run
            if not self.available(method, lr, seed):
                return None
            values.append(self.run(method, lr, seed)["validation"]["mean"])
        return statistics.fmean(values)

    def results(self) -> dict:
        """First every arm's sweep, then the other seeds at each arm's best rate (a call stopped halfway already
        compares the arms swept): each arm's rate, sweep, runs and scores."""
        results = {"methods": {}}
        arms = [m for m in ARMS if m in self.methods or self.ledger.rates(m)]
        sweeps = {
            m: sweep(self.setting, m, partial(self.score, m), self.ledger)
            for m in arms
            if not reference(self.setting, m)
        }
        for method in arms:
            if reference(self.setting, method):  # a reference arm runs at its reference's best rate, not swept
                scores = sweeps.get(reference(self.setting, method))
                best = None if scores is None else best_rate(scores)
                scores = None if best is None else {}
            else:
                scores = sweeps[method]
            if scores is None:
                continue
            best = best_rate(scores) if scores else best
            entries = [
                self.run(method, best, seed)
                for seed in range(self.setting["seeds"])
                if self.available(method, best, seed)
            ]
            results["methods"][method] = {
                "lr": best,
                "sweep": {f"{lr:g}": v for lr, v in scores.items()},
                "runs": [e["rounds"] for e in entries],
                "validation": [e["validation"] for e in entries],
                "seconds": [e["seconds"] for e in entries],
                "replay_rounds": self.setting["replay"] if ARMS[method].replay else 0,
                **({"reference": reference(self.setting, method)} if reference(self.setting, method) else {}),
            }
        for method, rates in self.setting.get("all_seeds_at", {}).items():  # every seed at these rates too
            for lr in rates:
                for seed in range(self.setting["seeds"]):
                    if method in arms and self.available(method, lr, seed):
                        self.run(method, lr, seed)
        return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SCALES), default="fast")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(ARMS),
        help="the arms to train (default: the scale's; the report covers every arm of the results)",
    )
    parser.add_argument("--work", help="unfinished runs, resumable (default: outputs/iterative-<scale>[-quick])")
    parser.add_argument(
        "--out",
        help="results (default: benchmarks/results/iterative-<scale>, "
        "outputs/iterative-<scale>-results-quick with --quick)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        help="seeds at each arm's best rate, in place of the scale's (with --out, beside its committed results)",
    )
    parser.add_argument(
        "--last_test_samples",
        type=int,
        help="samples per test prompt at the last round, in place of the scale's k (for pass@k up to it); only where "
        "the scale evaluates the test split at `test_rounds`",
    )
    parser.add_argument("--time_limit", type=float, help="minutes: stop after the run that crosses it")
    parser.add_argument(
        "--skip_seeds",
        type=int,
        nargs="+",
        default=[],
        help="seeds this call leaves untrained (another call of the same arms trains them at the same time)",
    )
    parser.add_argument("--report_only", action="store_true", help="write the finished runs' results, train nothing")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the runs the protocol may train and their estimated hours, train nothing",
    )
    parser.add_argument(
        "--use_vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sample and evaluate with vLLM (default: at the real scales, where vLLM is installed)",
    )
    args = parser.parse_args(argv)
    if args.use_vllm is None:
        import importlib.util

        args.use_vllm = args.scale != "fast" and importlib.util.find_spec("vllm") is not None
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    suffix = f"{args.scale}{'-quick' if args.quick else ''}"
    work = Path(args.work or ROOT / "outputs" / f"iterative-{suffix}")
    out = Path(
        args.out
        or ROOT
        / (
            f"outputs/iterative-{args.scale}-results-quick"
            if args.quick
            else f"benchmarks/results/iterative-{args.scale}"
        )
    )
    started = time.time()
    ledger = Ledger(out)
    overrides = {"seeds": args.seeds} if args.seeds else {}
    if args.last_test_samples:
        overrides["last_test_samples"] = args.last_test_samples
    setting = dict(SCALES[args.scale], **(QUICK if args.quick else {}), **overrides)
    if args.last_test_samples and setting["test_rounds"] is None:
        raise ValueError(
            f"--last_test_samples: the {args.scale} scale evaluates the test split every round with the loop, at its "
            f"k ({setting['k']}) samples a prompt; the option applies where it is evaluated at `test_rounds`."
        )
    methods = [m for m in ARMS if m in (args.methods or setting["methods"])]
    if args.plan:
        text = plan(setting, methods, ledger, args.skip_seeds)
        print(text)
        return text
    work.mkdir(parents=True, exist_ok=True)
    setting = dict(setup(args.scale, work, args.quick), **overrides)
    runs = Runs(setting, ledger, work, methods, args)
    results = runs.results()
    unfinished = [m for m in methods if len(results["methods"].get(m, {"runs": []})["runs"]) < setting["seeds"]]
    results["title"] = (
        f"{setting['description']}: {setting['prompts']} prompts x {setting['num_samples']} samples "
        f"per round, {setting['rounds']} rounds, batch {setting['batch']}"
    )
    results["settings"] = {
        k: v for k, v in setting.items() if isinstance(v, (int, float, str, bool, list, type(None))) and k != "model"
    }
    results["seconds_this_call"] = round(time.perf_counter() - runs.started)
    table, diagnosis = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    if results["methods"]:
        plot(results, out / "iterative.png")
    files = {
        "results.json": results,
        "table.md": f"{results['title']}\n\n{table}\n",
        "efficiency.md": f"{results['title']}\n\n{efficiency_table(results)}\n",
        "diagnosis.md": f"{results['title']}\n\n{diagnosis}\n",
        "ages.md": f"{results['title']}\n\n{ages_table(results)}\n",
        "sweep.md": f"{results['title']}\n\n{sweep_table(ledger, setting)}\n",
    }
    save(out, files, script=__file__, argv=argv, started=started, append=True)  # a record per call: it resumes
    status = (
        "complete"
        if not unfinished
        else (f"not finished: {', '.join(unfinished)}. Run the same command again to go on")
    )
    print(f"{results['title']}; {results['seconds_this_call']} s this call, {status}\n\n{table}\n\n{diagnosis}")
    return table


if __name__ == "__main__":
    main()
