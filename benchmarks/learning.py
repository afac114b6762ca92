"""Learning from one fixed offline dataset: TOPR against its family (REINFORCE, TIS, positives-only SFT, PPO-clip,
per-token TOPR, a target_positive_fraction sweep) and TRL's KTOTrainer and DPOTrainer, on identical rows.

    python benchmarks/learning.py --scale fast          # tiny Llama, synthetic task, 3 seeds: minutes on 2 CPU cores
    python benchmarks/learning.py --scale real          # SmolLM2-135M-Instruct, arithmetic: an hour on 2 CPU cores
    python benchmarks/learning.py --scale fast --quick  # smoke run: every method, one short epoch (test_benchmarks.py)

1. Behavior policy mu. fast: a tiny Llama (conftest's tokenizer) trained briefly with SFT to reverse 4 digits
   ("rev 3 9 1 4 =" -> " 4 1 9 3"), stopped at a middling accuracy (~15% of its samples correct: imbalanced data).
   real: SmolLM2-135M-Instruct as it is, on the README's embedded task, single-digit "What is a op b?" questions with
   a one-shot GSM8K-style prompt (~40% of its samples correct: balanced data).
2. One dataset: `sample_completions` draws `num_samples` completions per training prompt from mu at temperature 1
   (top-k off), scores them +1 correct / -1 otherwise (the paper's rewards) and records mu's log-probs.
3. Every method trains from mu's weights on exactly those rows (DPO: on correct/incorrect pairs built from them), with
   the same optimizer, learning rate, batch size, epochs and seed, and is evaluated on held-out prompts after each
   epoch: greedy pass@1, sampled pass@1, invalid and truncated rates, mean sample length, and the mean sequence
   log-prob of the positive and of the negative training completions (the same fixed subset for every method).

Writes `results.json`, `table.md` and `learning.png`, with their provenance, to --out (default
benchmarks/results/learning-<scale>, outputs/learning-<scale>-quick with --quick).
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from provenance import dumps, save
from tasks import PRETRAIN_ROWS, pretrain_reverser, reversal_answer, reversal_reward, reversal_rows


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]

# name -> TOPRConfig options (None: a TRL trainer)
METHODS = {
    "topr": {"loss_type": "topr"},
    "reinforce": {"loss_type": "reinforce"},
    "tis": {"loss_type": "tis"},
    "positives_only": {"loss_type": "positives_only"},
    "ppo_clip": {"loss_type": "ppo_clip"},
    "topr_token": {"loss_type": "topr", "ratio_level": "token"},
    "topr_peff0.1": {"loss_type": "topr", "target_positive_fraction": 0.1},
    "topr_peff0.2": {"loss_type": "topr", "target_positive_fraction": 0.2},
    "topr_peff0.5": {"loss_type": "topr", "target_positive_fraction": 0.5},
    "kto": None,
    "dpo": None,
}
SCALES = {
    # prompts: training prompts (x num_samples rows), eval: held-out prompts, k: samples per eval prompt
    "fast": {
        "prompts": 128,
        "num_samples": 8,
        "eval": 128,
        "k": 4,
        "epochs": 6,
        "seeds": 3,
        "lr": 1e-4,
        "batch": 16,
        "max_new_tokens": 12,
        "bf16": False,
    },
    "real": {
        "prompts": 20,
        "num_samples": 8,
        "eval": 48,
        "k": 2,
        "epochs": 2,
        "seeds": 1,
        "lr": 2e-5,
        "batch": 8,
        "max_new_tokens": 32,
        "bf16": False,
    },  # float32, as its committed run
}
QUICK = {"prompts": 16, "num_samples": 4, "eval": 4, "k": 1, "epochs": 1, "seeds": 1, "batch": 4}
PROBE_ROWS = 64  # positive and negative training rows whose log-probs are tracked


# ---------------------------------------------------------------------------------------------------------------- task
def setup(scale: str, work: str, quick: bool) -> dict:
    """Behavior model, held-out prompts and task functions of a scale."""
    from datasets import Dataset

    rng = random.Random(0)
    settings = dict(SCALES[scale], **(QUICK if quick else {}))
    if scale == "fast":
        # disjoint strings for mu's SFT, the training prompts and the held-out prompts
        numbers = rng.sample(range(10**4), PRETRAIN_ROWS + settings["prompts"] + settings["eval"])
        model = pretrain_reverser(str(Path(work) / "mu"), numbers[:PRETRAIN_ROWS])
        train = reversal_rows(numbers[PRETRAIN_ROWS : PRETRAIN_ROWS + settings["prompts"]])
        held_out = reversal_rows(numbers[PRETRAIN_ROWS + settings["prompts"] :])
        task = {"reward": reversal_reward, "answer": reversal_answer, "description": "reverse 4 digits"}
    else:
        from trl_topr import extract_final_answer, gsm8k_reward
        from trl_topr.embedded import smollm2_path
        from trl_topr.tasks import arithmetic_problems, few_shot_prompts

        # the README's embedded task: its 160 training and 83 test questions, its one-shot prompt
        model, problems = smollm2_path(), arithmetic_problems(0)
        train = list(few_shot_prompts(problems[1 : 1 + settings["prompts"]], problems[:1]))
        held_out = list(few_shot_prompts(problems[160 : 160 + settings["eval"]], problems[:1]))
        task = {
            "reward": gsm8k_reward,
            "answer": extract_final_answer,
            "description": "single-digit 'What is a op b?' (op in + - *), one-shot",
        }
    return dict(settings, model=model, train=Dataset.from_list(train), held_out=Dataset.from_list(held_out), **task)


# ------------------------------------------------------------------------------------------------------------- trainin
def common_args(setting: dict, out: str, seed: int) -> dict:
    from trl_topr.compat import CHECKPOINTING  # the name of the transformers installed
    from trl_topr.precision import resolve_bf16  # the library's rule, the same for every trainer compared

    return {
        "output_dir": out,
        "use_cpu": True,
        "bf16": resolve_bf16(setting["bf16"], use_cpu=True),
        "report_to": "none",
        "seed": seed,
        "learning_rate": setting["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "per_device_train_batch_size": setting["batch"],
        "num_train_epochs": setting["epochs"],
        "logging_steps": 10**6,
        "save_strategy": "no",
        CHECKPOINTING: False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def kto_rows(data):
    """KTO's unpaired format; desirable_weight set as TRL's docs advise for imbalanced data (weighted ratio ~1)."""
    rows = data.map(lambda r: {"label": r["reward"] > 0}).select_columns(["prompt", "completion", "label"])
    positives = sum(rows["label"])
    return rows, (len(rows) - positives) / max(positives, 1)


def dpo_pairs(data):
    """Per prompt with a correct completion: each incorrect completion paired with a correct one, in turn."""
    from datasets import Dataset

    by_prompt = {}
    for row in data:
        key = json.dumps(row["prompt"])
        by_prompt.setdefault(key, ([], [], row["prompt"]))[0 if row["reward"] > 0 else 1].append(row["completion"])
    pairs = [
        {"prompt": prompt, "chosen": pos[i % len(pos)], "rejected": neg_}
        for pos, neg, prompt in by_prompt.values()
        if pos and neg
        for i, neg_ in enumerate(neg)
    ]
    if not pairs:
        raise ValueError("DPO needs a prompt with both a correct and an incorrect completion; the dataset has none.")
    return Dataset.from_list(pairs)


def make_trainer(method: str, setting: dict, data, out: str, seed: int):
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from trl_topr import TOPRConfig, TOPRTrainer

    kw = common_args(setting, out, seed)
    if method == "kto":
        rows, desirable_weight = kto_rows(data)
        return KTOTrainer(
            setting["model"], args=KTOConfig(desirable_weight=desirable_weight, **kw), train_dataset=rows
        )
    if method == "dpo":
        return DPOTrainer(setting["model"], args=DPOConfig(**kw), train_dataset=dpo_pairs(data))
    return TOPRTrainer(setting["model"], args=TOPRConfig(**METHODS[method], **kw), train_dataset=data)


class Probe:
    """Mean log pi of fixed positive and negative training completions, tokenized as TOPRTrainer tokenizes them."""

    def __init__(self, setting: dict, data, out: str):
        from trl_topr import TOPRConfig, TOPRTrainer

        rewards = data["reward"]
        rows = [i for i, r in enumerate(rewards) if r > 0][:PROBE_ROWS] + [i for i, r in enumerate(rewards) if r <= 0][
            :PROBE_ROWS
        ]
        scorer = TOPRTrainer(
            setting["model"], args=TOPRConfig(**common_args(setting, out, 0)), train_dataset=data.select(rows)
        )
        dataset = scorer.train_dataset
        self.batches = [
            scorer.data_collator([dataset[j] for j in range(i, min(i + 16, len(dataset)))])
            for i in range(0, len(dataset), 16)
        ]

    def __call__(self, model) -> dict:
        import torch

        sums = {True: [], False: []}
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for batch in self.batches:
                batch = {k: v.to(model.device) for k, v in batch.items()}
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                labels = batch["labels"][:, 1:]
                mask = labels != -100
                logps = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                for value, positive in zip((logps * mask).sum(-1).tolist(), (batch["rewards"] > 0).tolist()):
                    sums[positive].append(value)
        model.train(was_training)

        def mean(v: list[float]) -> float:
            return sum(v) / len(v) if v else float("nan")

        return {"logp_positive": mean(sums[True]), "logp_negative": mean(sums[False])}


def evaluate(model, tokenizer, setting: dict, probe: Probe, seed: int) -> dict:
    from trl_topr import evaluate_policy
    from trl_topr.generation import SamplingSettings

    sampling = SamplingSettings(
        num_samples=setting["k"],
        temperature=1.0,
        top_k=0,
        max_new_tokens=setting["max_new_tokens"],
        batch_size=32,
        seed=seed,
    )
    metrics = evaluate_policy(
        model, tokenizer, setting["held_out"], setting["reward"], setting["answer"], sampling, progress=False
    )
    return {**metrics, **probe(model)}


def run_method(method: str, setting: dict, data, probe: Probe, seed: int, work: str) -> list[dict]:
    """Train `method` for the setting's epochs; the metrics after each epoch."""
    from transformers import PrinterCallback, TrainerCallback, set_seed

    set_seed(seed)
    trainer = make_trainer(method, setting, data, str(Path(work) / method), seed)
    history = []

    class EpochEnd(TrainerCallback):
        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            history.append(evaluate(model, trainer.processing_class, setting, probe, seed))

    trainer.add_callback(EpochEnd())
    trainer.remove_callback(PrinterCallback)  # no log dicts on stdout
    trainer.train()
    return history


# -------------------------------------------------------------------------------------------------------------- report
COLUMNS = [
    ("pass@1_greedy", "greedy"),
    ("pass@1", "sampled"),
    ("invalid_rate", "invalid"),
    ("truncated_rate", "truncated"),
    ("mean_length", "length"),
    ("logp_positive", "log pi(+)"),
    ("logp_negative", "log pi(-)"),
]


def summarize(results: dict) -> str:
    """Markdown: the last epoch of each method (mean over seeds, +- standard deviation with several), greedy pass@1
    per epoch, and the change in greedy pass@1 against TOPR's."""
    methods = [m for m in results["methods"] if m != "mu"]
    epochs = len(results["methods"][methods[0]][0])
    seeds = len(results["methods"][methods[0]])

    def stat(runs, epoch, key, digits=3):
        values = [run[epoch][key] for run in runs]
        mean = statistics.fmean(values)
        return f"{mean:.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")

    mu = results["methods"]["mu"][0][0]
    topr_final = statistics.fmean(run[-1]["pass@1_greedy"] for run in results["methods"]["topr"])
    header = [
        "method",
        *[f"greedy e{e + 1}" for e in range(epochs)],
        *[name for _, name in COLUMNS[1:]],
        "Δ greedy vs topr",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines.append(
        "| mu (epoch 0) | "
        + " | ".join([f"{mu['pass@1_greedy']:.3f}"] + [""] * (epochs - 1))
        + " | "
        + " | ".join(f"{mu[k]:.{1 if k.startswith(('logp', 'mean')) else 3}f}" for k, _ in COLUMNS[1:])
        + " | |"
    )
    for method in methods:
        runs = results["methods"][method]
        final = statistics.fmean(run[-1]["pass@1_greedy"] for run in runs)
        cells = [
            method,
            *[stat(runs, e, "pass@1_greedy") for e in range(epochs)],
            *[stat(runs, -1, k, 1 if k.startswith(("logp", "mean")) else 3) for k, _ in COLUMNS[1:]],
            f"{final - topr_final:+.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n{seeds} seed(s); columns after greedy e{epochs}: last epoch."


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("pass@1_greedy", "held-out greedy pass@1"),
        ("invalid_rate", "invalid rate (samples)"),
        ("logp_positive", "log pi of positive train completions"),
        ("logp_negative", "log pi of negative train completions"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    mu = results["methods"]["mu"][0][0]
    for method, runs in results["methods"].items():
        if method == "mu":
            continue
        style = {"linewidth": 2.5, "color": "black"} if method == "topr" else {"linewidth": 1.2}
        for ax, (key, title) in zip(axes, panels):
            values = [mu[key]] + [statistics.fmean(run[e][key] for run in runs) for e in range(len(runs[0]))]
            ax.plot(range(len(values)), values, marker="o", label=method, **style)
            ax.set_title(title)
            ax.set_xlabel("epoch")
    axes[0].legend(fontsize=8)
    fig.suptitle(results["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# ---------------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SCALES), default="fast")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one epoch, one seed")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--seeds", type=int, help="training seeds (default: 3 fast, 1 real)")
    parser.add_argument("--epochs", type=int, help="epochs over the dataset")
    parser.add_argument("--lr", type=float, help="learning rate (default: 1e-4 fast, 2e-5 real)")
    parser.add_argument(
        "--out",
        help="output folder (default: benchmarks/results/learning-<scale>, "
        "outputs/learning-<scale>-quick with --quick)",
    )
    args = parser.parse_args(argv)
    if "topr" not in args.methods:
        args.methods.insert(0, "topr")  # the reference of the comparison
    out = Path(
        args.out
        or ROOT
        / (f"outputs/learning-{args.scale}-quick" if args.quick else f"benchmarks/results/learning-{args.scale}")
    )
    started = time.time()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_topr import TOPRConfig, sample_completions
    from trl_topr.generation import SamplingSettings

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        setting = setup(args.scale, work, args.quick)
        setting["seeds"] = args.seeds or setting["seeds"]
        setting["epochs"] = args.epochs or setting["epochs"]
        setting["lr"] = args.lr or setting["lr"]
        data = sample_completions(
            setting["model"],
            setting["train"],
            {"correct": setting["reward"]},
            args=TOPRConfig(**common_args(setting, str(Path(work) / "sample"), 0)),
            progress=False,
            sampling=SamplingSettings(
                num_samples=setting["num_samples"],
                temperature=1.0,
                top_k=0,
                max_new_tokens=setting["max_new_tokens"],
                seed=0,
                batch_size=32,
            ),
        )
        # the sampled ids too: the per-token behavior log-probs cover them, and TOPRTrainer trains them exactly
        data = data.select_columns(
            ["prompt", "completion", "reward", "behavior_logps", "prompt_ids", "completion_ids"]
        )
        positives = sum(r > 0 for r in data["reward"])
        sampled_s = time.perf_counter() - t0
        print(
            f"dataset: {len(data)} rows, {positives} positive ({positives / len(data):.1%}); {sampled_s:.0f} s",
            file=sys.stderr,
            flush=True,
        )

        probe = Probe(setting, data, str(Path(work) / "probe"))
        tokenizer = AutoTokenizer.from_pretrained(setting["model"])
        mu = AutoModelForCausalLM.from_pretrained(setting["model"], dtype=torch.float32)
        results = {"methods": {"mu": [[evaluate(mu, tokenizer, setting, probe, 0)]]}}
        del mu
        for method in args.methods:
            results["methods"][method] = []
            for seed in range(setting["seeds"]):
                results["methods"][method].append(run_method(method, setting, data, probe, seed, work))
                out.mkdir(parents=True, exist_ok=True)
                (out / "results.json").write_text(dumps(results))  # partial, rewritten at the end
                print(
                    f"{method} seed {seed}: greedy "
                    + " ".join(f"{e['pass@1_greedy']:.3f}" for e in results["methods"][method][-1])
                    + f" ({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

    model_name = "tiny Llama (SFT'd reverser)" if args.scale == "fast" else "SmolLM2-135M-Instruct"
    results["title"] = (
        f"{model_name}, {setting['description']}: {len(data)} rows from mu "
        f"({positives / len(data):.1%} positive), {setting['epochs']} epochs, lr {setting['lr']}, "
        f"batch {setting['batch']}"
    )
    results["settings"] = {k: v for k, v in setting.items() if isinstance(v, (int, float, str, bool)) and k != "model"}
    results["dataset"] = {"rows": len(data), "positives": positives}
    results["seconds"] = round(time.perf_counter() - t0)
    table = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "learning.png")
    save(
        out,
        {"results.json": results, "table.md": f"{results['title']}; {results['seconds']} s in all\n\n{table}\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    print(f"{results['title']}; {results['seconds']} s in all\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
